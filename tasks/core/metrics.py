"""Classification metrics from logits and labels: plain numpy, rounded so the JSON is byte-stable."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

DIGITS = 6


def cross_entropy(logits: np.ndarray, labels: np.ndarray) -> float:
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return float(-log_probs[np.arange(len(labels)), labels].mean()) if len(labels) else 0.0


def confusion_matrix(labels: np.ndarray, predicted: np.ndarray, num_classes: int) -> np.ndarray:
    matrix = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(matrix, (labels, predicted), 1)
    return matrix


def classification_metrics(logits: np.ndarray, labels: np.ndarray, class_names: Sequence[str]) -> dict[str, Any]:
    """accuracy, loss, balanced accuracy, macro precision/recall/F1 and per-class figures (rows of the matrix:
    true class). Balanced accuracy is the mean recall over the classes the labels hold: on a long tail, plain
    accuracy is mostly the large classes'."""
    labels = np.asarray(labels, dtype=np.int64)
    predicted = logits.argmax(axis=1)
    matrix = confusion_matrix(labels, predicted, len(class_names))
    true_pos = np.diag(matrix).astype(np.float64)
    support = matrix.sum(axis=1)
    predicted_count = matrix.sum(axis=0)
    precision = np.divide(true_pos, predicted_count, out=np.zeros_like(true_pos), where=predicted_count > 0)
    recall = np.divide(true_pos, support, out=np.zeros_like(true_pos), where=support > 0)
    denom = precision + recall
    f1 = np.divide(2 * precision * recall, denom, out=np.zeros_like(true_pos), where=denom > 0)
    r = lambda x: round(float(x), DIGITS)  # noqa: E731
    return {
        "accuracy": r(true_pos.sum() / max(len(labels), 1)),
        "loss": r(cross_entropy(logits, labels)),
        "balanced_accuracy": r(recall[support > 0].mean()) if (support > 0).any() else 0.0,
        "macro_precision": r(precision.mean()),
        "macro_recall": r(recall.mean()),
        "macro_f1": r(f1.mean()),
        "num_samples": int(len(labels)),
        "per_class": {
            name: {"precision": r(precision[i]), "recall": r(recall[i]), "f1": r(f1[i]), "support": int(support[i])}
            for i, name in enumerate(class_names)
        },
    }


def worst_class(metrics: Mapping[str, Any]) -> tuple[str, float] | None:
    """(name, recall) of the class with the lowest recall among those with test images, None if there are none."""
    judged = [(v["recall"], name) for name, v in metrics.get("per_class", {}).items() if v["support"] > 0]
    if not judged:
        return None
    recall, name = min(judged)
    return name, recall
