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
1,000 classes: export calibrates each model's thresholds to a false-alarm rate (tasks/release/calibration.py)
and bench/bench_drift.py measures the rate they give.
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

from tasks.release.calibration import (
    SHARE_FLOOR,
    STATISTICS,
    Psi,
    calibrate,
    curve,
    shares,
)

REFERENCE_KEY = "drift_reference"
REFERENCE_VERSION = 2  # 2: calibrated thresholds
MAX_WINDOW = round(1 / SHARE_FLOOR)  # up to here an observed bin with a count is never under the floor (O(1) PSI)
RECOVER = 0.8  # after drift, "back" means every statistic under 0.8 x a fixed threshold (verdict and warning alike)
BINS = 10  # equal-mass bins of the test set's top-1 and margin
LEGACY_THRESHOLD = 0.25  # a reference without calibration (exported before it) and no threshold in params.yaml
OK, DRIFT, NOT_ENOUGH, NO_REFERENCE = "ok", "drift", "not enough data", "no reference"
VERDICTS = (OK, DRIFT, NOT_ENOUGH, NO_REFERENCE)


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

    @classmethod
    def fixed(cls, value: float, source: str) -> Threshold:
        return cls(value, 0.0, source, (RECOVER * value, 0.0))

    @classmethod
    def calibrated(cls, points: Mapping[int, float], recover: Mapping[int, float], source: str) -> Threshold:
        return cls(*curve(points), source, curve(recover))


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
        self._psi = [Psi(reference.counts(s)) for s in STATISTICS] if reference else []
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
