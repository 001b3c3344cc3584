"""Drift: how the served model's predictions compare with what it predicted on the test split.

export: test-split probabilities -> `build_reference` -> a reference (JSON) in the ONNX metadata under
`drift_reference` and in export.json: the predicted-class counts, counts of top-1 probability and of
margin (top-1 minus top-2) in bins of equal test-set mass (deciles), and each statistic's threshold at
the server's window sizes, calibrated to a false-alarm rate (`calibrate`).

serving: each prediction -> `DriftWindow.add` (the last `window` predictions, counted per class and
per bin, each statistic kept up to date in O(1)) -> `DriftWindow.report()`: the population stability
index (PSI) of the class mix, of top-1 and of margin against the reference, each with its threshold and
where it came from, and a verdict with hysteresis. Pure numpy/stdlib (no torch, no scipy): the torch-free
serving venv imports it.

PSI = sum over bins of (observed - expected) * ln(observed / expected), a share never below 1e-4 so
an empty bin stays finite. Its sampling noise grows with the number of bins (the class mix has one per
class) and shrinks with the window and the test split, so no fixed threshold means the same for 10 and
1,000 classes: the thresholds are the null distribution's quantile instead. Calibration draws a population
from the test split's counts (Dirichlet, counts + 1/2: a class the test split never predicted still gets
a little mass), then a test split of the same size and a window from it, and takes the PSI between the two;
the threshold is the 1 - rate/3 quantile of that PSI (a third of the rate per statistic: the verdict's
false-alarm rate is at most the configured one). bench/bench_drift.py measures the rate it gives.
"""

from __future__ import annotations

import json
import math
import threading
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

REFERENCE_KEY = "drift_reference"
REFERENCE_VERSION = 2  # 2: calibrated thresholds
SHARE_FLOOR = 1e-4  # the share an empty bin counts as
MAX_WINDOW = round(1 / SHARE_FLOOR)  # up to here an observed bin with a count is never under the floor (O(1) PSI)
RECOVER = 0.8  # after drift, "back" means every statistic under 0.8 x a fixed threshold (verdict and warning alike)
RECOVER_QUANTILE = 0.9  # ... or under the 90th percentile of its values on test-like traffic, when calibrated
BINS = 10  # equal-mass bins of the test set's top-1 and margin
STATISTICS = ("class_mix_psi", "top1_psi", "margin_psi")
LEGACY_THRESHOLD = 0.25  # a reference without calibration (exported before it) and no threshold in params.yaml
OK, DRIFT, NOT_ENOUGH, NO_REFERENCE = "ok", "drift", "not enough data", "no reference"
VERDICTS = (OK, DRIFT, NOT_ENOUGH, NO_REFERENCE)
PRIOR = 0.5  # Dirichlet pseudo-count per bin when drawing populations like the test split's (Jeffreys)
CHUNK_CELLS = 20_000_000  # streams x bins held at once while calibrating (memory bound: 160 MB of int64)


class DriftReferenceError(ValueError):
    """A model's drift reference does not fit the model (other classes, malformed)."""


def top1_and_margin(probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Probabilities (N, classes) -> top-1 probability and margin to the second, each (N,)."""
    top2 = -np.sort(-np.asarray(probs, dtype=np.float64), axis=1)[:, :2]
    second = top2[:, 1] if top2.shape[1] > 1 else np.zeros(len(top2))
    return top2[:, 0], top2[:, 0] - second


def _edges(values: np.ndarray, bins: int) -> list[float]:
    """Inner bin edges at the values' quantiles (real sample values, duplicates dropped)."""
    inner = np.quantile(values, np.linspace(0, 1, bins + 1)[1:-1], method="inverted_cdf")
    return [float(v) for v in np.unique(inner)]


def _counts(values: np.ndarray, edges: Sequence[float]) -> list[int]:
    return np.bincount(np.searchsorted(np.asarray(edges), values, side="right"), minlength=len(edges) + 1).tolist()


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
    bookkeeping as `_Psi`, vectorised across streams."""
    low, window = sizes
    psi = _Psi(counts)
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
        a, b = Threshold.curve({low: float(np.quantile(first, 1 - per_statistic)),
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


def build_reference(
    probs: np.ndarray,
    class_names: Sequence[str],
    split: str = "test",
    *,
    sizes: Iterable[int] = (),
    false_alarm_rate: float = 0.01,
    seed: int = 0,
) -> dict[str, Any]:
    """The reference of a model: what it predicted on `split` (probabilities (N, classes)), with thresholds
    calibrated at the window `sizes` (the server's min_predictions and window; none: uncalibrated)."""
    probs = np.asarray(probs, dtype=np.float64)
    if probs.ndim != 2 or probs.shape[1] != len(class_names) or len(probs) == 0:
        raise ValueError(f"expected probabilities (N >= 1, {len(class_names)}), got {probs.shape}")
    top1, margin = top1_and_margin(probs)
    top1_edges, margin_edges = _edges(top1, BINS), _edges(margin, BINS)
    predicted = np.bincount(probs.argmax(axis=1), minlength=len(class_names)).tolist()
    reference: dict[str, Any] = {
        "version": REFERENCE_VERSION,
        "split": split,
        "num_samples": len(probs),
        "classes": list(class_names),
        "class_counts": predicted,
        "top1": {"edges": top1_edges, "counts": _counts(top1, top1_edges)},
        "margin": {"edges": margin_edges, "counts": _counts(margin, margin_edges)},
    }
    sizes = list(sizes)
    if sizes:
        counts = {"class_mix_psi": predicted, "top1_psi": reference["top1"]["counts"],
                  "margin_psi": reference["margin"]["counts"]}  # fmt: skip
        reference["calibration"] = calibrate(counts, sizes, false_alarm_rate, seed)
    return reference


def reference_json(reference: dict[str, Any]) -> str:
    """The reference as the metadata value: compact, keys sorted, so the same model gives the same bytes."""
    return json.dumps(reference, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class Calibrated:
    """Thresholds calibrated at export: {statistic: {window size: threshold}} at a false-alarm rate, and the
    levels a statistic must be back under to end a drift verdict (RECOVER_QUANTILE of test-like windows)."""

    false_alarm_rate: float
    thresholds: Mapping[str, Mapping[int, float]]
    recover: Mapping[str, Mapping[int, float]]


@dataclass(frozen=True)
class Reference:
    num_samples: int
    classes: tuple[str, ...]
    class_counts: tuple[int, ...]
    top1_edges: tuple[float, ...]
    top1_counts: tuple[int, ...]
    margin_edges: tuple[float, ...]
    margin_counts: tuple[int, ...]
    split: str
    calibration: Calibrated | None = None

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str], class_names: Sequence[str], source: str) -> Reference | None:
        """The reference the model file carries, or None (an older export); one-line errors name the file."""
        text = metadata.get(REFERENCE_KEY)
        if text is None:
            return None
        where = f"{source}: metadata '{REFERENCE_KEY}'"
        try:
            raw = json.loads(text)
            calibration = None
            if "calibration" in raw:
                cal = raw["calibration"]
                thresholds, recover = ({s: {int(n): float(t) for n, t in cal[key][s].items()} for s in STATISTICS}
                                       for key in ("thresholds", "recover"))  # fmt: skip
                if any(not v or min(v.values()) <= 0 for v in thresholds.values()):
                    raise ValueError("a calibrated threshold is missing or not positive")
                calibration = Calibrated(float(cal["false_alarm_rate"]), thresholds, recover)
            ref = cls(
                int(raw["num_samples"]), tuple(map(str, raw["classes"])), tuple(map(int, raw["class_counts"])),
                tuple(map(float, raw["top1"]["edges"])), tuple(map(int, raw["top1"]["counts"])),
                tuple(map(float, raw["margin"]["edges"])), tuple(map(int, raw["margin"]["counts"])),
                str(raw.get("split", "test")), calibration,
            )  # fmt: skip
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise DriftReferenceError(f"{where} is malformed ({type(exc).__name__}: {exc})") from None
        unknown = [c for c in ref.classes if c not in class_names]
        if unknown:
            raise DriftReferenceError(f"{where} names classes the model does not have: {', '.join(unknown)} "
                                      f"(the model's: {', '.join(class_names)})")  # fmt: skip
        if list(ref.classes) != list(class_names) or len(ref.class_counts) != len(ref.classes):
            raise DriftReferenceError(f"{where}: classes {list(ref.classes)} are not the model's {list(class_names)}")
        for name, edges, counts in (("top1", ref.top1_edges, ref.top1_counts),
                                    ("margin", ref.margin_edges, ref.margin_counts)):  # fmt: skip
            if len(counts) != len(edges) + 1 or list(edges) != sorted(edges):
                raise DriftReferenceError(f"{where}: {name} has {len(edges)} edges and {len(counts)} counts")
        return ref

    def counts(self, statistic: str) -> tuple[int, ...]:
        return {"class_mix_psi": self.class_counts, "top1_psi": self.top1_counts,
                "margin_psi": self.margin_counts}[statistic]  # fmt: skip


def shares(counts: Sequence[int]) -> list[float]:
    """Counts -> shares, none below SHARE_FLOOR: an empty bin stays finite in the log, and a bin empty on
    both sides adds nothing."""
    total = sum(counts) or 1
    return [max(c / total, SHARE_FLOOR) for c in counts]


def psi_terms(observed: Sequence[int], expected: Sequence[int]) -> list[float]:
    """Each bin's contribution to the population stability index (their sum is the PSI)."""
    return [(o - e) * math.log(o / e) for o, e in zip(shares(observed), shares(expected), strict=True)]


@dataclass(frozen=True)
class Threshold:
    """A statistic's threshold as a function of the window's fill n: a + b / n (a PSI's sampling noise goes as
    1/n), through the calibrated points; a fixed threshold is b = 0. `source` says where it came from, and
    `recover` is the curve a drift verdict ends under (RECOVER x a fixed threshold)."""

    a: float
    b: float
    source: str
    recover: tuple[float, float] = (0.0, 0.0)

    def at(self, n: int) -> float:
        return self.a + self.b / max(n, 1)

    def recover_at(self, n: int) -> float:
        return self.recover[0] + self.recover[1] / max(n, 1)

    @staticmethod
    def curve(points: Mapping[int, float]) -> tuple[float, float]:
        """(a, b) of a + b/n through the smallest and largest calibrated window sizes (one size: flat)."""
        (n1, t1), (n2, t2) = min(points.items()), max(points.items())
        if n1 == n2:
            return t1, 0.0
        b = (t1 - t2) / (1 / n1 - 1 / n2)
        return t2 - b / n2, b

    @classmethod
    def fixed(cls, value: float, source: str) -> Threshold:
        return cls(value, 0.0, source, (RECOVER * value, 0.0))

    @classmethod
    def calibrated(cls, points: Mapping[int, float], recover: Mapping[int, float], source: str) -> Threshold:
        return cls(*cls.curve(points), source, cls.curve(recover))


@dataclass(frozen=True)
class DriftThresholds:
    window: int
    min_predictions: int
    limits: Mapping[str, Threshold]

    @classmethod
    def fixed(cls, window: int, min_predictions: int, value: float, source: str = "fixed") -> DriftThresholds:
        return cls(window, min_predictions, {s: Threshold.fixed(value, source) for s in STATISTICS})

    @classmethod
    def resolve(cls, params: Any, reference: Reference | None) -> tuple[DriftThresholds, list[str]]:
        """The thresholds the server uses, and warnings to log: a number in params.yaml serve.drift.<statistic>
        is used as it is; else the reference's calibrated curve; else (an older reference) LEGACY_THRESHOLD."""
        limits, warnings = {}, []
        calibration = reference.calibration if reference else None
        for stat in STATISTICS:
            fixed = getattr(params, stat)
            if fixed is not None:
                limits[stat] = Threshold.fixed(float(fixed), f"fixed: params.yaml serve.drift.{stat}")
                if calibration is not None:
                    calibrated = Threshold.calibrated(calibration.thresholds[stat], calibration.recover[stat], "")
                    if fixed < calibrated.at(params.window):
                        level, rate = calibrated.at(params.window), calibration.false_alarm_rate
                        warnings.append(f"serve.drift.{stat} {fixed:g} is under the {level:.3g} that test-like "
                                        f"traffic reaches in {rate:g} of windows of {params.window}: expect false "
                                        "drift alarms; leave it empty to use the calibrated threshold")  # fmt: skip
            elif calibration is not None:
                rate = calibration.false_alarm_rate
                sizes = "/".join(map(str, sorted(calibration.thresholds[stat])))
                limits[stat] = Threshold.calibrated(calibration.thresholds[stat], calibration.recover[stat],
                                                    f"calibrated at export: false-alarm rate {rate:g} per window, "
                                                    f"windows of {sizes}")  # fmt: skip
            else:
                limits[stat] = Threshold.fixed(LEGACY_THRESHOLD, f"fixed {LEGACY_THRESHOLD}: the model's reference "
                                               "has no calibrated thresholds (exported before them); re-export to "
                                               "calibrate")  # fmt: skip
        if reference is not None and calibration is None and any(getattr(params, s) is None for s in STATISTICS):
            warnings.append(f"the drift reference has no calibrated thresholds (an older export): fixed "
                            f"{LEGACY_THRESHOLD} is used; re-export the model to calibrate them")  # fmt: skip
        if calibration is not None:
            wanted = {params.min_predictions, params.window}
            calibrated = set(next(iter(calibration.thresholds.values())))
            if calibration.false_alarm_rate != params.false_alarm_rate or wanted != calibrated:
                warnings.append(f"the drift thresholds were calibrated at export for false-alarm rate "
                                f"{calibration.false_alarm_rate:g} and windows {sorted(calibrated)}; serve.drift asks "
                                f"{params.false_alarm_rate:g} and {sorted(wanted)}: the calibrated ones are used "
                                "(interpolated in 1/n); re-export after changing serve.drift")  # fmt: skip
        return cls(params.window, params.min_predictions, limits), warnings

    def of(self, statistic: str, n: int) -> float:
        return self.limits[statistic].at(n)

    def exceeded(self, values: Mapping[str, float], n: int) -> list[str]:
        """The statistics over their thresholds at a window of n predictions."""
        return [s for s in STATISTICS if values[s] > self.of(s, n)]

    def recovered(self, values: Mapping[str, float], n: int) -> bool:
        """Every statistic back under the level that ends a drift verdict."""
        return all(values[s] <= self.limits[s].recover_at(n) for s in STATISTICS)


class _Psi:
    """The PSI of a histogram of the window's predictions against fixed expected counts, kept up to date in O(1)
    per change of one bin. With n <= MAX_WINDOW predictions a bin holding c >= 1 has share c/n >= SHARE_FLOOR,
    so only empty bins are floored and, summing over the bins with c > 0,

        PSI = (A - B)/n - ln n - C + D ln n + G + Z_all

    with A = sum c ln c, B = sum c ln e, C = sum e ln c, D = sum e, G = sum (e ln e - z), where e is a bin's
    expected share and z = (f - e) ln(f / e) the term of an empty bin (Z_all: summed over every bin)."""

    def __init__(self, expected: Sequence[int]) -> None:
        self.e = shares(expected)
        self.log_e = [math.log(e) for e in self.e]
        z = [(SHARE_FLOOR - e) * math.log(SHARE_FLOOR / e) for e in self.e]
        self.g = [e * le - zi for e, le, zi in zip(self.e, self.log_e, z, strict=True)]
        self.z_all = math.fsum(z)
        self.counts = [0] * len(self.e)
        self._sums = [0.0] * 5  # A, B, C, D, G

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
        self._sums = [0.0] * 5
        for i, c in enumerate(self.counts):
            self._bin(i, c, 1.0)

    def value(self, n: int) -> float:
        if n == 0:
            return 0.0
        a, b, c, d, g = self._sums
        ln_n = math.log(n)
        return max((a - b) / n - ln_n - c + d * ln_n + g + self.z_all, 0.0)


class DriftWindow:
    """The last `window` predictions of this process, counted per class and per top-1 / margin bin.

    `add` is O(1) under a lock (O(log bins) to bin top-1 and margin). The verdict has hysteresis: it turns
    `drift` when a statistic crosses its threshold and `ok` again only when every statistic is back under its
    recover level (RECOVER x a fixed threshold; the 90th percentile of test-like windows when calibrated), so a
    window that hovers at a threshold neither flaps between verdicts nor warns on every prediction;
    `on_change(verdict, report)` is called at each of the two turns. Thread-safe: the server's streams call
    `add`."""

    def __init__(self, classes: Sequence[str], reference: Reference | None, thresholds: DriftThresholds,
                 on_change: Callable[[str, dict[str, Any]], None] | None = None) -> None:  # fmt: skip
        if thresholds.window > MAX_WINDOW:
            raise ValueError(f"drift window {thresholds.window} > {MAX_WINDOW}")
        self.classes, self.reference, self.thresholds = tuple(classes), reference, thresholds
        self._on_change = on_change
        self._lock = threading.Lock()
        self._recent: deque[tuple[int, int, int]] = deque()
        self.total = [0] * len(self.classes)  # every prediction since start, by class
        self._psi = [_Psi(reference.counts(s)) for s in STATISTICS] if reference else []
        self._top1 = [0] * (len(reference.top1_counts) if reference else 1)
        self._margin = [0] * (len(reference.margin_counts) if reference else 1)
        self._classes = [0] * len(self.classes)
        self._alert = False  # drift found, and not yet back under every recover level
        self._since_refresh = 0

    def add(self, index: int, top1: float, margin: float) -> None:
        ref = self.reference
        # bin 0 below the first inner edge, len(edges) at or above the last: as _counts bins the reference
        t = bisect_right(ref.top1_edges, top1) if ref else 0
        m = bisect_right(ref.margin_edges, margin) if ref else 0
        changed = False
        with self._lock:
            self.total[index] += 1
            self._recent.append((index, t, m))
            self._move((index, t, m), 1)
            if len(self._recent) > self.thresholds.window:
                self._move(self._recent.popleft(), -1)
            n = len(self._recent)
            if ref is None or n < self.thresholds.min_predictions:
                return
            self._since_refresh += 1
            if self._since_refresh >= self.thresholds.window:
                self._since_refresh = 0
                for psi in self._psi:
                    psi.refresh()
            values = self._statistics()
            if not self._alert and self.thresholds.exceeded(values, n):
                self._alert = changed = True
            elif self._alert and self.thresholds.recovered(values, n):
                self._alert, changed = False, True
        if changed and self._on_change is not None:
            self._on_change(DRIFT if self._alert else OK, self.report())

    def _move(self, entry: tuple[int, int, int], by: int) -> None:
        index, t, m = entry
        self._classes[index] += by
        self._top1[t] += by
        self._margin[m] += by
        if self._psi:
            for psi, i in zip(self._psi, entry, strict=True):
                psi.change(i, by)

    @property
    def verdict(self) -> str:
        """The verdict now, as /drift gives it."""
        if self.reference is None:
            return NO_REFERENCE
        if self.filled < self.thresholds.min_predictions:
            return NOT_ENOUGH
        return DRIFT if self._alert else OK

    @property
    def filled(self) -> int:
        return len(self._recent)

    def values(self) -> dict[str, float] | None:
        """Each statistic's value now, or None without a reference."""
        if self.reference is None:
            return None
        with self._lock:
            return self._statistics()

    def threshold(self, statistic: str) -> float:
        """A statistic's threshold at the window's fill now (at least min_predictions)."""
        return self.thresholds.of(statistic, max(self.filled, self.thresholds.min_predictions))

    def _statistics(self) -> dict[str, float]:
        n = len(self._recent)
        return {s: psi.value(n) for s, psi in zip(STATISTICS, self._psi, strict=True)}

    def report(self) -> dict[str, Any]:
        """What /drift answers: window, per-class shares, each statistic with its threshold, verdict."""
        th = self.thresholds
        with self._lock:
            n, classes = len(self._recent), list(self._classes)
            top1, margin, total = list(self._top1), list(self._margin), list(self.total)
            values = self._statistics() if self.reference else None
            alert = self._alert
        ref = self.reference
        report: dict[str, Any] = {
            "window": {"size": th.window, "filled": n, "min_predictions": th.min_predictions},
            "predictions_total": dict(zip(self.classes, total, strict=True)),
        }
        if ref is None or values is None:
            return {"verdict": NO_REFERENCE, **report,
                    "detail": "the served model carries no drift reference (exported before drift references); "
                              "re-export it to watch drift"}  # fmt: skip
        observed = [c / n if n else 0.0 for c in classes]
        expected = [c / ref.num_samples for c in ref.class_counts]
        terms = psi_terms(classes, ref.class_counts)
        per_class = [{"class": name, "observed": round(o, 4), "expected": round(e, 4), "contribution": round(t, 4)}
                     for name, o, e, t in zip(self.classes, observed, expected, terms, strict=True)]  # fmt: skip
        at = max(n, th.min_predictions)
        verdict = NOT_ENOUGH if n < th.min_predictions else DRIFT if alert else OK
        over = th.exceeded(values, at) if verdict != NOT_ENOUGH else []
        statistics = {s: {"value": round(values[s], 4), "threshold": round(th.of(s, at), 4), "exceeded": s in over,
                          "recover": round(th.limits[s].recover_at(at), 4), "source": th.limits[s].source}
                      for s in STATISTICS}  # fmt: skip
        moved = sorted(per_class, key=lambda row: -abs(row["observed"] - row["expected"]))[:3]
        return {
            "verdict": verdict,
            **report,
            "hysteresis": "drift from a statistic over its threshold until every statistic is back under its "
            "recover level",
            "reference": {"split": ref.split, "num_samples": ref.num_samples},
            "statistics": statistics,
            "classes": per_class,
            "moved_most": [{"class": r["class"], "change": round(r["observed"] - r["expected"], 4)} for r in moved],
            "top1": {"edges": list(ref.top1_edges), "observed": top1, "expected": list(ref.top1_counts)},
            "margin": {"edges": list(ref.margin_edges), "observed": margin, "expected": list(ref.margin_counts)},
        }
