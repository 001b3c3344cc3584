"""Drift thresholds calibrated to a false-alarm rate: a test split's counts -> each statistic's threshold curve.

A PSI's sampling noise grows with the number of bins (the class mix has one per class) and shrinks with the
window and the test split, so no fixed threshold means the same for 10 and 1,000 classes. `calibrate` draws
streams of predictions like the test split's and sets each statistic's threshold where at most rate/3 of them
ever cross it (tasks/release/drift_reference.py stores the result in the model's reference; the server reads it). `Psi`
keeps a window's PSI up to date in O(1) per prediction, for the server and, vectorised, for the calibration.
Pure numpy/stdlib: the torch-free serving venv imports it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, MutableSequence, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

SHARE_FLOOR = 1e-4  # the share an empty bin counts as
STATISTICS = ("class_mix_psi", "top1_psi", "margin_psi")
RECOVER_QUANTILE = 0.9  # a calibrated drift verdict ends under the 90th percentile of test-like windows
PRIOR = 0.5  # Dirichlet pseudo-count per bin when drawing populations like the test split's (Jeffreys)
CHUNK_CELLS = 20_000_000  # streams x bins held at once while calibrating (memory bound: 160 MB of int64)


def shares(counts: Sequence[int]) -> list[float]:
    """Counts -> shares, none below SHARE_FLOOR: an empty bin stays finite in the log, and a bin empty on
    both sides adds nothing."""
    total = sum(counts) or 1
    return [max(c / total, SHARE_FLOOR) for c in counts]


def curve(points: Mapping[int, float]) -> tuple[float, float]:
    """(a, b) of a + b/n through the smallest and largest of {n: value} (one point: flat, b = 0)."""
    (n1, t1), (n2, t2) = min(points.items()), max(points.items())
    if n1 == n2:
        return t1, 0.0
    b = (t1 - t2) / (1 / n1 - 1 / n2)
    return t2 - b / n2, b


class Psi:
    """The PSI of a histogram of the window's predictions against fixed expected counts, kept up to date in O(1)
    per change of one bin. With n <= MAX_WINDOW predictions a bin holding c >= 1 has share c/n >= SHARE_FLOOR,
    so only empty bins are floored and, summing over the bins with c > 0,

        PSI = (A - B)/n - ln n - C + D ln n + G + Z_all

    with A = sum c ln c, B = sum c ln e, C = sum e ln c, D = sum e, G = sum (e ln e - z), where e is a bin's
    expected share and z = (f - e) ln(f / e) the term of an empty bin (Z_all: summed over every bin)."""

    def __init__(self, expected: Sequence[int], counts: MutableSequence[int] | None = None,
                 sums: MutableSequence[float] | None = None) -> None:  # fmt: skip
        """`counts` (one per bin) and `sums` (5) may be given: arrays a drift window keeps where its workers share
        them (tasks/release/window_memory.py); else lists of this object's own."""
        self.e = shares(expected)
        self.log_e = [math.log(e) for e in self.e]
        z = [(SHARE_FLOOR - e) * math.log(SHARE_FLOOR / e) for e in self.e]
        self.g = [e * le - zi for e, le, zi in zip(self.e, self.log_e, z, strict=True)]
        self.z_all = math.fsum(z)
        self.counts = [0] * len(self.e) if counts is None else counts
        self._sums = [0.0] * 5 if sums is None else sums  # A, B, C, D, G

    def _bin(self, i: int, c: int, sign: float) -> None:
        if c == 0:
            return
        lc, e = math.log(c), self.e[i]
        s = self._sums
        s[0] += sign * c * lc
        s[1] += sign * c * self.log_e[i]
        s[2] += sign * e * lc
        s[3] += sign * e
        s[4] += sign * self.g[i]

    def change(self, i: int, by: int) -> None:
        c = self.counts[i]
        self._bin(i, c, -1.0)
        self.counts[i] = c + by
        self._bin(i, c + by, 1.0)

    def refresh(self) -> None:
        """The sums recomputed from the counts (bounds rounding drift from long runs of updates)."""
        for k in range(5):
            self._sums[k] = 0.0  # in place: the array may be shared
        for i, c in enumerate(self.counts):
            self._bin(i, c, 1.0)

    def value(self, n: int) -> float:
        if n == 0:
            return 0.0
        a, b, c, d, g = self._sums
        ln_n = math.log(n)
        return max((a - b) / n - ln_n - c + d * ln_n + g + self.z_all, 0.0)


def prior_strength(counts: Sequence[int]) -> float:
    """The pseudo-count a of a symmetric Dirichlet(a) prior over the bins' shares, from how much more the counts
    vary across bins than a multinomial of equal shares would (method of moments; empirical Bayes): bins of
    equal mass (top-1, margin deciles; a balanced class mix) give a large a, a skewed mix a small one. Never
    under PRIOR (Jeffreys) nor over 10,000."""
    r = np.asarray(counts, dtype=np.float64)
    k, n = len(r), float(r.sum())
    if k < 2 or n == 0:
        return PRIOR
    equal = n / k * (1 - 1 / k)  # the variance of a bin's count under equal shares
    extra = float(r.var(ddof=1)) - equal
    if extra <= 0:
        return 10_000.0
    return float(np.clip((n * equal / extra - 1) / k, PRIOR, 10_000.0))


def _path_psi(counts: Sequence[int], prior: float, sizes: tuple[int, int], draws: int,
              rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """The PSI a window shows along a stream drawn like the test split: a population drawn anew per stream from
    Dirichlet(counts + prior) (the test split's posterior: a bin it left empty, or nearly, still gets mass),
    a window filled from empty to sizes[1] predictions and then slid as far again. (draws, steps) PSI from the
    first step with sizes[0] predictions on, and (steps,) the window's fill at each step. The same O(1)
    bookkeeping as `Psi`, vectorised across streams."""
    low, window = sizes
    psi = Psi(counts)
    e, log_e, g = np.array(psi.e), np.array(psi.log_e), np.array(psi.g)
    c = np.arange(window + 2, dtype=np.float64)
    log_c = np.log(np.maximum(c, 1))
    c_log_c, present = c * log_c, (c > 0).astype(np.float64)
    steps = 2 * window
    fill = np.minimum(np.arange(1, steps + 1), window)
    out = np.empty((draws, steps - low + 1))
    chunk = min(max(CHUNK_CELLS // len(e), 100), 2000)  # small chunks stay in cache: 3x faster than one big one
    for first in range(0, draws, chunk):
        b = min(chunk, draws - first)
        cdf = np.cumsum(rng.dirichlet(np.asarray(counts, dtype=np.float64) + prior, size=b), axis=1)
        stream = np.stack([np.searchsorted(row, rng.random(steps) * row[-1], side="right") for row in cdf])
        stream = np.minimum(stream, len(e) - 1)
        flat = (stream + np.arange(b)[:, None] * len(e)).T.copy()  # (steps, b): each step's bins in `held`
        e_at, log_e_at, g_at = (np.ascontiguousarray(table[stream].T) for table in (e, log_e, g))
        held = np.zeros(b * len(e), dtype=np.int64)
        sums = np.zeros((5, b))  # A, B, C, D, G as in _Psi
        for t in range(steps):
            moves = [(t, 1)] + ([(t - window, -1)] if t >= window else [])
            for at, by in moves:
                where = flat[at]
                old = held[where]
                new = old + by
                step = present[new] - present[old]
                sums[0] += c_log_c[new] - c_log_c[old]
                sums[1] += by * log_e_at[at]
                sums[2] += e_at[at] * (log_c[new] - log_c[old])
                sums[3] += step * e_at[at]
                sums[4] += step * g_at[at]
                held[where] = new
            n = fill[t]
            if n >= low:
                ln_n = math.log(n)
                value = (sums[0] - sums[1]) / n - ln_n - sums[2] + sums[3] * ln_n + sums[4] + psi.z_all
                out[first : first + b, t - low + 1] = np.maximum(value, 0.0)
    return out, fill[low - 1 :]


def calibration_draws(false_alarm_rate: float) -> int:
    """Enough streams for about 12 beyond the per-statistic quantile (at least 1,000, at most 20,000): 3,600 at
    rate 0.01, about a second per statistic on 2 cores; bench/bench_drift.py measures the rate they give."""
    return int(min(max(math.ceil(12 * len(STATISTICS) / false_alarm_rate), 1000), 20_000))


def calibrate(counts: Mapping[str, Sequence[int]], sizes: Iterable[int], false_alarm_rate: float,
              seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """Each statistic's threshold at the window sizes (min_predictions, window), as a curve a + b/n.

    The verdict has hysteresis, so what a reader of /drift sees depends on the window's path, not only on its
    statistic now: a threshold at the statistic's own 1 - rate quantile would be crossed somewhere along the
    path far more often than at the read. So the curve's shape is the per-size quantile (through the two
    sizes, in 1/n), and its height is set so that the path's largest statistic / curve crosses 1 in at most
    rate/3 of streams (a third of the rate per statistic: the verdict's rate is at most the configured one)."""
    per_statistic = false_alarm_rate / len(STATISTICS)
    draws = calibration_draws(false_alarm_rate)
    rng = np.random.default_rng(seed)
    low, high = min(sizes), max(sizes)
    # The class mix's prior comes from how its counts vary (a class the test split left empty, or nearly, gets
    # the mass its peers suggest); the deciles hold equal counts by construction, so Jeffreys' 1/2 there.
    priors = {"class_mix_psi": prior_strength(counts["class_mix_psi"]), "top1_psi": PRIOR, "margin_psi": PRIOR}
    thresholds, heights, recover = {}, {}, {}
    paths: dict[tuple[tuple[int, ...], float], tuple[np.ndarray, np.ndarray]] = {}
    for stat in STATISTICS:
        key = (tuple(counts[stat]), priors[stat])  # top-1 and margin deciles often hold the same counts
        if key not in paths:
            paths[key] = _path_psi(counts[stat], priors[stat], (low, high), draws, rng)
        path, fill = paths[key]
        first, full = path[:, 0], path[:, high - low]  # fresh windows of min_predictions and of window
        a, b = curve({low: float(np.quantile(first, 1 - per_statistic)),
                                high: float(np.quantile(full, 1 - per_statistic))})  # fmt: skip
        height = max(float(np.quantile((path / (a + b / fill)).max(axis=1), 1 - per_statistic)), 1.0)
        heights[stat] = round(height, 4)
        thresholds[stat] = {str(n): round(height * (a + b / n), 6) for n in sorted({low, high})}
        recover[stat] = {str(n): round(float(np.quantile(values, RECOVER_QUANTILE)), 6)
                         for n, values in sorted({low: first, high: full}.items())}  # fmt: skip
    return {"false_alarm_rate": false_alarm_rate, "per_statistic_rate": round(per_statistic, 8), "draws": draws,
            "seed": seed, "priors": {k: round(v, 4) for k, v in priors.items()}, "path_factor": heights,
            "method": "largest PSI along a window's path (filled, then slid a window's length), streams drawn from "
                      "Dirichlet(test counts + prior) populations",
            "thresholds": thresholds, "recover": recover}  # fmt: skip


@dataclass(frozen=True)
class Calibration:
    """What export calibrates a reference's thresholds for: the server's window sizes and false-alarm rate."""

    sizes: tuple[int, ...]
    false_alarm_rate: float
    seed: int = 0

    @classmethod
    def of(cls, drift: Any, seed: int = 0) -> Calibration:
        """From params.yaml serve.drift (DriftParams)."""
        return cls((drift.min_predictions, drift.window), drift.false_alarm_rate, seed)
