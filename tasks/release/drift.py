"""Drift: how the served model's predictions compare with what it predicted on the test split.

export: test-split probabilities -> `build_reference` -> a reference (JSON) in the ONNX metadata under
`drift_reference` and in export.json: the predicted-class counts, and counts of top-1 probability and
of margin (top-1 minus top-2) in bins of equal test-set mass (deciles).

serving: each prediction -> `DriftWindow.add` (the last `window` predictions, counted per class and
per bin) -> `DriftWindow.report()`: the population stability index (PSI) of the class mix, of top-1
and of margin against the reference, each with its threshold, and a verdict. Pure numpy/stdlib (no
torch): the torch-free serving venv imports it.

PSI = sum over bins of (observed - expected) * ln(observed / expected), a share never below 1e-4 so
an empty bin stays finite. Rule of thumb: < 0.1 no change, 0.1-0.25 some, > 0.25 a shift.
"""

from __future__ import annotations

import json
import math
import threading
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

REFERENCE_KEY = "drift_reference"
REFERENCE_VERSION = 1
SHARE_FLOOR = 1e-4  # the share an empty bin counts as
RECOVER = 0.8  # after a drift warning, "back" means every statistic under 0.8 x its threshold
BINS = 10  # equal-mass bins of the test set's top-1 and margin
STATISTICS = ("class_mix_psi", "top1_psi", "margin_psi")
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


def build_reference(probs: np.ndarray, class_names: Sequence[str], split: str = "test") -> dict[str, Any]:
    """The reference of a model: what it predicted on `split` (probabilities (N, classes))."""
    probs = np.asarray(probs, dtype=np.float64)
    if probs.ndim != 2 or probs.shape[1] != len(class_names) or len(probs) == 0:
        raise ValueError(f"expected probabilities (N >= 1, {len(class_names)}), got {probs.shape}")
    top1, margin = top1_and_margin(probs)
    top1_edges, margin_edges = _edges(top1, BINS), _edges(margin, BINS)
    predicted = np.bincount(probs.argmax(axis=1), minlength=len(class_names)).tolist()
    return {
        "version": REFERENCE_VERSION,
        "split": split,
        "num_samples": len(probs),
        "classes": list(class_names),
        "class_counts": predicted,
        "top1": {"edges": top1_edges, "counts": _counts(top1, top1_edges)},
        "margin": {"edges": margin_edges, "counts": _counts(margin, margin_edges)},
    }


def reference_json(reference: dict[str, Any]) -> str:
    """The reference as the metadata value: compact, keys sorted, so the same model gives the same bytes."""
    return json.dumps(reference, sort_keys=True, separators=(",", ":"))


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

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str], class_names: Sequence[str], source: str) -> Reference | None:
        """The reference the model file carries, or None (an older export); one-line errors name the file."""
        text = metadata.get(REFERENCE_KEY)
        if text is None:
            return None
        where = f"{source}: metadata '{REFERENCE_KEY}'"
        try:
            raw = json.loads(text)
            ref = cls(
                int(raw["num_samples"]), tuple(map(str, raw["classes"])), tuple(map(int, raw["class_counts"])),
                tuple(map(float, raw["top1"]["edges"])), tuple(map(int, raw["top1"]["counts"])),
                tuple(map(float, raw["margin"]["edges"])), tuple(map(int, raw["margin"]["counts"])),
                str(raw.get("split", "test")),
            )  # fmt: skip
        except (ValueError, KeyError, TypeError) as exc:
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


def sampling_psi(reference: Reference, window: int) -> float:
    """About the PSI over the top-1 (or margin) deciles that a full window drawn exactly like the test set shows
    from sampling alone: (bins - 1) / n for each of the two samples (the reference's and the window's)."""
    bins = len(reference.top1_counts)
    return (bins - 1) / reference.num_samples + (bins - 1) / window


def shares(counts: Sequence[int]) -> list[float]:
    """Counts -> shares, none below SHARE_FLOOR: an empty bin stays finite in the log, and a bin empty on
    both sides adds nothing."""
    total = sum(counts) or 1
    return [max(c / total, SHARE_FLOOR) for c in counts]


def psi_terms(observed: Sequence[int], expected: Sequence[int]) -> list[float]:
    """Each bin's contribution to the population stability index (their sum is the PSI)."""
    return [(o - e) * math.log(o / e) for o, e in zip(shares(observed), shares(expected), strict=True)]


@dataclass(frozen=True)
class DriftThresholds:
    window: int
    min_predictions: int
    class_mix_psi: float
    top1_psi: float
    margin_psi: float

    def of(self, statistic: str) -> float:
        return float(getattr(self, statistic))

    def exceeded(self, values: Mapping[str, float]) -> list[str]:
        """The statistics over their thresholds."""
        return [s for s in STATISTICS if values[s] > self.of(s)]

    def verdict(self, values: Mapping[str, float] | None, filled: int) -> str:
        """What /drift says of a window of `filled` predictions with these statistics (None: no reference)."""
        if values is None:
            return NO_REFERENCE
        if filled < self.min_predictions:
            return NOT_ENOUGH
        return DRIFT if self.exceeded(values) else OK


class DriftWindow:
    """The last `window` predictions of this process, counted per class and per top-1 / margin bin.

    `add` is O(log bins) under a lock and calls `on_change(verdict, report)` once when a statistic
    crosses its threshold (drift) and once when every statistic is back under RECOVER x its threshold
    (ok): the margin keeps a window that hovers at a threshold from warning on every prediction.
    Thread-safe: the server's streams call `add`."""

    def __init__(self, classes: Sequence[str], reference: Reference | None, thresholds: DriftThresholds,
                 on_change: Callable[[str, dict[str, Any]], None] | None = None) -> None:  # fmt: skip
        self.classes, self.reference, self.thresholds = tuple(classes), reference, thresholds
        self._on_change = on_change
        self._lock = threading.Lock()
        self._recent: deque[tuple[int, int, int]] = deque()
        self.total = [0] * len(self.classes)  # every prediction since start, by class
        self._classes = [0] * len(self.classes)
        self._top1 = [0] * (len(reference.top1_counts) if reference else 1)
        self._margin = [0] * (len(reference.margin_counts) if reference else 1)
        self._alert = False  # warned of drift, and not yet back under RECOVER x every threshold

    def add(self, index: int, top1: float, margin: float) -> None:
        ref = self.reference
        # bin 0 below the first inner edge, len(edges) at or above the last: as _counts bins the reference
        t = bisect_right(ref.top1_edges, top1) if ref else 0
        m = bisect_right(ref.margin_edges, margin) if ref else 0
        with self._lock:
            self.total[index] += 1
            self._classes[index] += 1
            self._top1[t] += 1
            self._margin[m] += 1
            self._recent.append((index, t, m))
            if len(self._recent) > self.thresholds.window:
                old_c, old_t, old_m = self._recent.popleft()
                self._classes[old_c] -= 1
                self._top1[old_t] -= 1
                self._margin[old_m] -= 1
            if ref is None or len(self._recent) < self.thresholds.min_predictions:
                return
            values = self._statistics()
            if not self._alert and self.thresholds.exceeded(values):
                self._alert = changed = True
            elif self._alert and all(values[s] <= RECOVER * self.thresholds.of(s) for s in STATISTICS):
                self._alert, changed = False, True
            else:
                changed = False
        if changed and self._on_change is not None:
            self._on_change(DRIFT if self._alert else OK, self.report())

    @property
    def verdict(self) -> str:
        """The verdict now, as /drift gives it."""
        return self.thresholds.verdict(self.values(), self.filled)

    @property
    def filled(self) -> int:
        return len(self._recent)

    def values(self) -> dict[str, float] | None:
        """Each statistic's value now, or None without a reference."""
        if self.reference is None:
            return None
        with self._lock:
            return self._statistics()

    def _statistics(self) -> dict[str, float]:
        ref = self.reference
        assert ref is not None
        return {
            "class_mix_psi": sum(psi_terms(self._classes, ref.class_counts)),
            "top1_psi": sum(psi_terms(self._top1, ref.top1_counts)),
            "margin_psi": sum(psi_terms(self._margin, ref.margin_counts)),
        }

    def report(self) -> dict[str, Any]:
        """What /drift answers: window, per-class shares, each statistic with its threshold, verdict."""
        th = self.thresholds
        with self._lock:
            n, classes = len(self._recent), list(self._classes)
            top1, margin, total = list(self._top1), list(self._margin), list(self.total)
            values = self._statistics() if self.reference else None
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
        verdict = th.verdict(values, n)
        over = th.exceeded(values) if verdict != NOT_ENOUGH else []
        statistics = {s: {"value": round(values[s], 4), "threshold": th.of(s), "exceeded": s in over}
                      for s in STATISTICS}  # fmt: skip
        moved = sorted(per_class, key=lambda row: -abs(row["observed"] - row["expected"]))[:3]
        return {
            "verdict": verdict,
            **report,
            "reference": {"split": ref.split, "num_samples": ref.num_samples},
            "statistics": statistics,
            "classes": per_class,
            "moved_most": [{"class": r["class"], "change": round(r["observed"] - r["expected"], 4)} for r in moved],
            "top1": {"edges": list(ref.top1_edges), "observed": top1, "expected": list(ref.top1_counts)},
            "margin": {"edges": list(ref.margin_edges), "observed": margin, "expected": list(ref.margin_counts)},
        }
