"""Error analysis over per-image predictions: the loss of each image under its given label, the test
images the model gets most wrong, and the likely label errors of a whole dataset.

Plain numpy over logits, labels and manifest entries; `tasks/evaluate.py` feeds it every accepted image.
A likely label error is judged out of sample (the idea of cleanlab's confident learning: a model that did not
train on an image says what it is): val and test images by the final model, training images by their area
under the margin during training, which a mislabeled image keeps low until it is memorised.
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


HELD_OUT = "final model, held out"  # val and test images: the final model never trained on them
DURING_TRAINING = "area under the margin during training"  # train images (tasks/training/dynamics.py)


def margins(logits: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(logit of the given label minus the largest other logit (N,): negative when the model prefers another;
    the class of that largest other logit (N,))."""
    z = np.asarray(logits, dtype=np.float64)
    rows = np.arange(len(labels))
    other = z.copy()
    other[rows, labels] = -np.inf
    best_other = other.argmax(axis=1)
    return z[rows, labels] - other[rows, best_other], best_other


def label_error_ranking(
    logits: np.ndarray, entries: Sequence[Mapping[str, Any]], class_names: Sequence[str],
    roots: Mapping[str, str], count: int, *, train_aum: np.ndarray, train_p_given: np.ndarray,
    times_trained: np.ndarray, temperature: float,
) -> list[dict[str, Any]]:  # fmt: skip
    """The `count` likeliest label errors, each judged by a model that did not learn it: lowest score first.

    `entries[i]` is image i's manifest entry (split, index, label, path, root, sha256) and `logits[i]` the
    final model's; `roots` maps an entry's root name to the folder it was read from, so `file` is the path a
    user can open and fix. A val or test image's score is the final model's margin (`margins`); a training
    image's is its area under the margin (`train_aum[index]`): the final model has memorised its training
    images, mislabeled ones too, so its verdict on them says little. A training image that no step drew
    (`times_trained` 0: whole batches only) is held out too, and the final model scores it. `suggested` is
    the class the final model likes best after the given one. The final model's probabilities are the served
    ones, softmax(logits / `temperature`) (model.pt's), so a candidate's `p_suggested` and an upload's top-1
    probability are on one scale where the review page sorts them together; the margin ranks as before.
    """
    labels = np.array([entry["label"] for entry in entries], dtype=np.int64)
    log_probs = log_softmax(np.asarray(logits, dtype=np.float64) / temperature)
    rows = np.arange(len(labels))
    (score, suggested), p_given = margins(logits, labels), np.exp(log_probs[rows, labels])
    index = np.array([entry["index"] for entry in entries], dtype=np.int64)
    in_train = np.array([entry["split"] == "train" for entry in entries], dtype=bool)
    in_train[in_train] = times_trained[index[in_train]] > 0
    train_index = index[in_train]
    score[in_train], p_given[in_train] = train_aum[train_index], train_p_given[train_index]
    predicted = log_probs.argmax(axis=1)
    r = lambda x: round(float(x), DIGITS)  # noqa: E731
    ranked = []
    for rank, i in enumerate(np.argsort(score, kind="stable")[:count].tolist(), start=1):
        entry = entries[i]
        ranked.append({
            "rank": rank,
            "file": f"{roots.get(entry['root'], entry['root'])}/{entry['path']}",
            "split": entry["split"],
            "sha256": entry["sha256"],
            "given": class_names[labels[i]],
            "suggested": class_names[suggested[i]],
            "score": r(score[i]),
            "scored_by": DURING_TRAINING if in_train[i] else HELD_OUT,
            "p_given": r(p_given[i]),
            "predicted": class_names[predicted[i]],
            "p_predicted": r(np.exp(log_probs[i, predicted[i]])),
            "p_suggested": r(np.exp(log_probs[i, suggested[i]])),
        })  # fmt: skip
    return ranked
