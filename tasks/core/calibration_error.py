"""Logits + labels (+ a temperature) -> how far confidence is from accuracy: the expected calibration error over
equal-width bins of top-1 probability, the negative log-likelihood, and the bins a reliability diagram draws.

Pure numpy, probabilities in float64 from the logits, so training, evaluate and the torch-free release side agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tasks.core.analysis import log_softmax

BINS = 15  # Guo et al. 2017 (On Calibration of Modern Neural Networks) and most papers since


def scaled_log_probs(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """log softmax(logits / T) in float64 (N, classes)."""
    return log_softmax(np.asarray(logits, dtype=np.float64) / float(temperature))


def nll(logits: np.ndarray, labels: np.ndarray, temperature: float = 1.0) -> float:
    """Mean negative log-likelihood of the given labels under softmax(logits / T)."""
    if len(labels) == 0:
        return float("nan")
    log_probs = scaled_log_probs(logits, temperature)
    return float(-log_probs[np.arange(len(labels)), np.asarray(labels, dtype=np.int64)].mean())


@dataclass(frozen=True)
class Reliability:
    """Per bin of top-1 probability ((k/bins, (k+1)/bins], the first closed at 0): images, mean confidence and
    accuracy (0 where the bin is empty). ECE = sum over bins of (images / total) x |accuracy - confidence|."""

    counts: np.ndarray  # (bins,) int
    confidence: np.ndarray  # (bins,) float64
    accuracy: np.ndarray  # (bins,) float64

    @property
    def bins(self) -> int:
        return len(self.counts)

    @property
    def ece(self) -> float:
        total = self.counts.sum()
        if total == 0:
            return float("nan")
        return float((self.counts / total * np.abs(self.accuracy - self.confidence)).sum())


def reliability(logits: np.ndarray, labels: np.ndarray, temperature: float = 1.0, bins: int = BINS) -> Reliability:
    """Top-1 probability of softmax(logits / T) binned into `bins` equal-width bins, with each bin's accuracy."""
    probs = np.exp(scaled_log_probs(logits, temperature)) if len(labels) else np.zeros((0, 1))
    confidence = probs.max(axis=1)
    correct = (probs.argmax(axis=1) == np.asarray(labels, dtype=np.int64)).astype(np.float64)
    # (k/bins, (k+1)/bins] -> k; a top-1 probability is at least 1/classes, so never 0 in practice
    index = np.clip(np.ceil(confidence * bins).astype(np.int64) - 1, 0, bins - 1)
    counts = np.bincount(index, minlength=bins)
    safe = np.maximum(counts, 1)
    return Reliability(
        counts=counts,
        confidence=np.bincount(index, weights=confidence, minlength=bins) / safe,
        accuracy=np.bincount(index, weights=correct, minlength=bins) / safe,
    )


def expected_calibration_error(
    logits: np.ndarray, labels: np.ndarray, temperature: float = 1.0, bins: int = BINS
) -> float:
    return reliability(logits, labels, temperature, bins).ece


def calibration_report(logits: np.ndarray, labels: np.ndarray, temperature: float, bins: int = BINS) -> dict[str, Any]:
    """metrics.json's `calibration`: ECE and NLL with the model's temperature and without it (T = 1), and, as
    served (with T), the mean top-1 probability and the share of images whose top-1 probability is below one half
    (serve.low_confidence's default). Rounded to 6 places so the JSON is byte-stable; None on an empty split."""
    confidence = np.exp(scaled_log_probs(logits, temperature)).max(axis=1) if len(labels) else np.zeros(0)

    def r(value: float) -> float | None:
        return round(float(value), 6) if len(labels) else None

    return {
        "temperature": float(temperature),
        "bins": bins,
        "ece": r(expected_calibration_error(logits, labels, temperature, bins)),
        "ece_uncalibrated": r(expected_calibration_error(logits, labels, 1.0, bins)),
        "nll": r(nll(logits, labels, temperature)),
        "nll_uncalibrated": r(nll(logits, labels, 1.0)),
        "mean_confidence": r(confidence.mean() if len(confidence) else 0.0),
        "share_below_half": r((confidence < 0.5).mean() if len(confidence) else 0.0),
    }
