"""A model's drift reference: what it predicted on the test split, as export stores it in the ONNX metadata.

export: test-split probabilities -> `build_reference` -> a reference (JSON) in the ONNX metadata under
`drift_reference` and in export.json: the predicted-class counts, counts of top-1 probability and of
margin (top-1 minus top-2) in bins of equal test-set mass (deciles), and each statistic's threshold at
the server's window sizes, calibrated to a false-alarm rate (`calibrate`). The server reads it back with
`Reference.from_metadata`; tasks/release/drift.py holds the window that compares traffic with it.
Pure numpy/stdlib: the torch-free serving venv imports it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tasks.release.calibration import STATISTICS, calibrate

REFERENCE_KEY = "drift_reference"
REFERENCE_VERSION = 2  # 2: calibrated thresholds
BINS = 10  # equal-mass bins of the test set's top-1 and margin


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
