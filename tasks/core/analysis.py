"""Error analysis over per-image predictions: the loss of each image under its given label, the test
images the model gets most wrong, and the likely label errors of a whole dataset.

Plain numpy over logits, labels and manifest entries; `tasks/evaluate.py` feeds it every accepted image.
The rule for a likely label error is the one of confident learning's simplest form: rank images by the
final model's loss on the label they were given (highest first). A mislabeled image the model did not
memorise shows up near the top, with the class the model believes it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tasks.core.metrics import DIGITS


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def image_losses(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Cross-entropy of each image under its given label (N,)."""
    return -log_softmax(logits)[np.arange(len(labels)), np.asarray(labels, dtype=np.int64)]


def highest_loss(losses: np.ndarray, count: int) -> np.ndarray:
    """Indices of the `count` highest losses, highest first; ties by index (stable)."""
    return np.argsort(-losses, kind="stable")[:count]


def label_error_ranking(
    logits: np.ndarray, entries: Sequence[Mapping[str, Any]], class_names: Sequence[str],
    roots: Mapping[str, str], count: int,
) -> list[dict[str, Any]]:  # fmt: skip
    """The `count` images with the highest loss under their given label, each with the file it came from.

    `entries[i]` is image i's manifest entry (split, index, label, path, root, sha256); `roots` maps an
    entry's root name to the folder it was read from, so `file` is the path a user can open and fix.
    """
    labels = np.array([entry["label"] for entry in entries], dtype=np.int64)
    log_probs = log_softmax(logits)
    losses = -log_probs[np.arange(len(labels)), labels]
    predicted = log_probs.argmax(axis=1)
    r = lambda x: round(float(x), DIGITS)  # noqa: E731
    ranked = []
    for rank, i in enumerate(highest_loss(losses, count).tolist(), start=1):
        entry = entries[i]
        ranked.append({
            "rank": rank,
            "file": f"{roots[entry['root']]}/{entry['path']}",
            "split": entry["split"],
            "sha256": entry["sha256"],
            "given": class_names[labels[i]],
            "predicted": class_names[predicted[i]],
            "p_given": r(np.exp(log_probs[i, labels[i]])),
            "p_predicted": r(np.exp(log_probs[i, predicted[i]])),
            "loss": r(losses[i]),
        })  # fmt: skip
    return ranked
