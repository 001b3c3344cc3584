"""Two models' predictions on the same images, and the paired tests a gate rule is judged by. Pure.

Given both models' predictions on the same images (`Paired`: check_regression scores the baseline on today's
test set too), a worsening beyond the tolerance fails only when a one-sided paired test says it is not chance
(p < alpha), so that equal models do not fail by the luck of a few images:
- accuracy and per_class.<c>.recall are the fraction of a set of images classified right (all test images; those
  whose true class is c): McNemar's exact test (tasks/core/mcnemar.py) on the images the two models disagree on.
  Such a rule whose set is too small to detect its tolerance at all (`judgeable`: even the smallest loss beyond
  the tolerance, k images, all of them discordant, gives p = 0.5^k >= alpha) says "too few images to judge"
  and does not fail the verdict, unless the loss it sees is beyond the tolerance and significant anyway.
- the other metrics of the confusion matrix (macro_f1, macro_precision, macro_recall, per-class precision and
  f1) are no fraction of one fixed set of images: a paired bootstrap over the test images (BOOTSTRAP_RESAMPLES
  resamples of both models' predictions together, a fixed seed, so the verdict is byte-stable), p = the share
  of resamples in which the candidate is not worse.
- anything else (loss, a hash) is compared on the tolerance alone (tasks/release/verdict.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tasks.core.mcnemar import discordant, mcnemar_p

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
EPS = 1e-12  # a worsening equal to the tolerance is within it, whatever the float rounding
_CHUNK = 4_000_000  # resampled images per bootstrap chunk: bounds memory on big test sets


@dataclass(frozen=True)
class Paired:
    """Both models' predicted class index for the same images, with the images' true class index, in one order
    (check_regression: today's test split, each model scored through the serving path)."""

    labels: Sequence[int]
    candidate: Sequence[int]
    baseline: Sequence[int]
    class_names: tuple[str, ...]

    def __post_init__(self) -> None:
        if not len(self.labels) == len(self.candidate) == len(self.baseline):
            raise ValueError(f"paired predictions of unequal length: {len(self.labels)} labels, "
                             f"{len(self.candidate)} candidate, {len(self.baseline)} baseline")  # fmt: skip


def smallest_failing_loss(allowed: float, n: int) -> int:
    """The fewest images (net) a rule on a fraction of `n` images must lose to be worse than `allowed`."""
    return math.floor((allowed + EPS) * n) + 1


def judgeable(allowed: float, n: int, alpha: float, *, two_sided: bool = False) -> bool:
    """Whether McNemar's test on `n` images can detect a loss beyond `allowed` at all: the smallest such loss,
    k images, all of them discordant (b = k, c = 0, the most significant way to lose them), reaches p < alpha.
    (With alpha 0.05 that takes k >= 5: a 0.05 tolerance needs 80 images, a 0.02 tolerance 200.)"""
    k = smallest_failing_loss(allowed, n)
    return k <= n and mcnemar_p(k, 0, two_sided=two_sided) < alpha


class PairedStats:
    """The per-image arrays of a `Paired`, and the bootstrap's per-class counts, computed once per verdict."""

    def __init__(self, paired: Paired) -> None:
        self.labels = np.asarray(paired.labels, dtype=np.int64)
        self.predicted = {"candidate": np.asarray(paired.candidate, dtype=np.int64),
                          "baseline": np.asarray(paired.baseline, dtype=np.int64)}  # fmt: skip
        self.class_names = paired.class_names
        self._boot: dict[str, np.ndarray] | None = None

    def proportion_set(self, metric: str) -> np.ndarray | None:
        """The images a McNemar metric is the fraction of (a boolean mask), or None for other metrics."""
        if metric == "accuracy":
            return np.ones(len(self.labels), dtype=bool)
        parts = metric.split(".")
        if len(parts) == 3 and parts[0] == "per_class" and parts[2] == "recall" and parts[1] in self.class_names:
            return self.labels == self.class_names.index(parts[1])
        return None

    def mcnemar(self, mask: np.ndarray, direction: str) -> tuple[int, float]:
        """(images in the set, p) of McNemar's exact test of the candidate being worse on the images of `mask`."""
        right = {model: predicted[mask] == self.labels[mask] for model, predicted in self.predicted.items()}
        lost, won = discordant(right["baseline"], right["candidate"])
        if direction == "lower":  # a fraction right where lower is better: gaining images is the worsening
            lost, won = won, lost
        return int(mask.sum()), mcnemar_p(lost, won, two_sided=direction == "equal")

    def bootstrap_values(self, metric: str) -> tuple[np.ndarray, np.ndarray] | None:
        """The metric of (candidate, baseline) in each bootstrap resample, or None when the confusion matrix
        does not give it."""
        parts = metric.split(".")
        if metric in ("accuracy", "macro_precision", "macro_recall", "macro_f1"):
            name, index = metric.removeprefix("macro_"), None
        elif len(parts) == 3 and parts[0] == "per_class" and parts[1] in self.class_names and parts[2] in (
            "precision", "recall", "f1"):  # fmt: skip
            name, index = parts[2], self.class_names.index(parts[1])
        else:
            return None
        boot = self._bootstrap()
        values = []
        for model in ("candidate", "baseline"):
            true_pos, predicted, support = boot[f"{model}_tp"], boot[f"{model}_predicted"], boot["support"]
            if name == "accuracy":
                values.append(true_pos.sum(axis=1) / max(len(self.labels), 1))
                continue
            precision = np.divide(true_pos, predicted, out=np.zeros(true_pos.shape), where=predicted > 0)
            recall = np.divide(true_pos, support, out=np.zeros(true_pos.shape), where=support > 0)
            denom = precision + recall
            f1 = np.divide(2 * precision * recall, denom, out=np.zeros(true_pos.shape), where=denom > 0)
            per_class = {"precision": precision, "recall": recall, "f1": f1}[name]
            values.append(per_class.mean(axis=1) if index is None else per_class[:, index])
        return values[0], values[1]

    def _bootstrap(self) -> dict[str, np.ndarray]:
        """Per resample (BOOTSTRAP_RESAMPLES, classes): true positives and predictions per class of each model,
        and the support; both models are resampled on the same images."""
        if self._boot is not None:
            return self._boot
        n, classes = len(self.labels), max(len(self.class_names), 1)
        rng = np.random.default_rng(BOOTSTRAP_SEED)
        counts: dict[str, list[np.ndarray]] = {}
        rows = max(1, _CHUNK // max(n, 1))
        for start in range(0, BOOTSTRAP_RESAMPLES, rows):
            size = min(rows, BOOTSTRAP_RESAMPLES - start)
            pick = rng.integers(0, n, size=(size, n)) if n else np.zeros((size, 0), np.int64)
            labels = self.labels[pick]
            counts.setdefault("support", []).append(_per_row_counts(labels, classes))
            for model, predicted in self.predicted.items():
                guess = predicted[pick]
                counts.setdefault(f"{model}_predicted", []).append(_per_row_counts(guess, classes))
                counts.setdefault(f"{model}_tp", []).append(_per_row_counts(labels, classes, guess == labels))
        self._boot = {key: np.concatenate(parts).astype(np.float64) for key, parts in counts.items()}
        return self._boot

    def bootstrap_p(self, metric: str, direction: str) -> float | None:
        """The share of resamples in which the candidate is not worse (with the +1 of a resampling p-value);
        `equal`: two-sided. None when the metric is not one of the confusion matrix."""
        values = self.bootstrap_values(metric)
        if values is None:
            return None
        delta = values[0] - values[1]
        total = len(delta) + 1
        if direction == "equal":
            return min(1.0, 2 * min((np.sum(delta <= 0) + 1) / total, (np.sum(delta >= 0) + 1) / total))
        worsening = -delta if direction == "higher" else delta
        return float((np.sum(worsening <= EPS) + 1) / total)


def _per_row_counts(values: np.ndarray, classes: int, where: np.ndarray | None = None) -> np.ndarray:
    """(rows, n) class indices -> (rows, classes) counts of each class per row (only where `where`)."""
    rows = values.shape[0]
    flat = (values + (np.arange(rows) * classes)[:, None]).ravel()
    weights = None if where is None else where.ravel().astype(np.float64)
    return np.bincount(flat, weights=weights, minlength=rows * classes).reshape(rows, classes)
