"""Two models' predictions on the same images, and the paired tests a gate rule is judged by. Pure.

Given both models' predictions on the same images (`Paired`: check_regression scores the baseline on today's
test set too), a worsening beyond the tolerance fails only when a one-sided paired test says it is not chance,
at the level Holm's correction gives it among the gate's rules (tasks/release/family.py):
- accuracy and per_class.<c>.recall are the fraction of a set of images classified right (all test images; those
  whose true class is c): McNemar's exact test (tasks/core/mcnemar.py) on the images the two models disagree on.
  Such a rule whose set is too small to detect its tolerance at its level (`judgeable`: even the smallest loss
  beyond the tolerance, k images, all of them discordant, gives p = 0.5^k >= the level) is not judged: the
  verdict says so and how many images it would need (`images_needed`).
- the other metrics of the confusion matrix (macro_f1, macro_precision, macro_recall, per-class precision and
  f1) are no fraction of one fixed set of images: the exact paired sign-flip permutation test. Under "equal",
  which model made which of an image's two predictions is a coin toss, so each image's pair is swapped or not;
  p = the share of the 2^d swaps (d: images the two predict differently) whose metric difference is at least as
  bad for the candidate. scipy.stats.permutation_test enumerates them when 2^d <= PERMUTATION_RESAMPLES + 1;
  else up to that many random swaps are drawn (a fixed seed, so the verdict is byte-stable), stopped early once
  the p-value is clearly large (Besag & Clifford's sequential p-value; `sign_flip_p`).
- anything else (loss, a hash) is compared on the tolerance alone (tasks/release/verdict.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tasks.core.mcnemar import discordant, mcnemar_p

PERMUTATION_RESAMPLES = 9999  # random swaps when 2^d is more, at least; p can then be no smaller than 1 / 10,000
MAX_RESAMPLES = 10**7 - 1  # at most: a level of 1e-6 (alpha 0.05 over 50,000 rules); early stops keep it rare
PERMUTATION_SEED = 0
STOP_AFTER = 10  # sampled swaps at least as bad as the observed one that end the draw early (Besag & Clifford)
EPS = 1e-12  # a worsening equal to the tolerance is within it, whatever the float rounding
_CHUNK = 4_000_000  # swapped images per batch of the permutation test: bounds memory on big test sets
_MACRO = ("accuracy", "macro_precision", "macro_recall", "macro_f1")
MCNEMAR, SIGN_FLIP = "McNemar", "sign-flip"


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
    """Whether McNemar's test on `n` images can detect a loss beyond `allowed` at level `alpha` at all: the smallest
    such loss, k images, all of them discordant (b = k, c = 0, the most significant way to lose them), reaches
    p < alpha. (At 0.05 that takes k >= 5: a 0.05 tolerance needs 80 images, a 0.02 tolerance 200.)"""
    k = smallest_failing_loss(allowed, n)
    return k <= n and mcnemar_p(k, 0, two_sided=two_sided) < alpha


def resamples_for(level: float) -> int:
    """Random swaps enough for the sign-flip test to reach `level` (its smallest p, 1 / (resamples + 1), a tenth
    of it): the draw scales with the family, so a rule that could fail is never unjudged for want of swaps."""
    return int(min(MAX_RESAMPLES, max(PERMUTATION_RESAMPLES, math.ceil(10 / max(level, 1e-300)) - 1)))


def sign_flip_floor(n: int, *, two_sided: bool = False, resamples: int = MAX_RESAMPLES) -> float:
    """The smallest p the sign-flip test can give on `n` differing images: every swap better for the baseline
    (2^-n), or one in resamples + 1 once it samples swaps instead of enumerating them."""
    floor = max(0.5 ** min(n, 1074), 1 / (resamples + 1))
    return min(1.0, 2 * floor) if two_sided else floor


def images_needed(allowed: float, alpha: float, *, two_sided: bool = False) -> int | None:
    """The fewest images on which McNemar's test can detect a loss beyond `allowed` at level `alpha`
    (`judgeable`); None when no number can (a tolerance of 0 asks a single lost image to be significant)."""
    losses = 1
    while mcnemar_p(losses, 0, two_sided=two_sided) >= alpha:  # the fewest all-discordant losses that reach alpha
        losses += 1
    if allowed >= 1 or smallest_failing_loss(allowed, 10**9) < losses:  # no loss of a fraction is beyond 1
        return None
    n = max(losses, math.floor((losses - 1) / max(allowed, EPS)) - 1)
    while not judgeable(allowed, n, alpha, two_sided=two_sided):
        n += 1
    return n


class PairedStats:
    """The per-image arrays of a `Paired`, and each test's p-value, computed once per verdict."""

    def __init__(self, paired: Paired) -> None:
        self.labels = np.asarray(paired.labels, dtype=np.int64)
        self.predicted = {"candidate": np.asarray(paired.candidate, dtype=np.int64),
                          "baseline": np.asarray(paired.baseline, dtype=np.int64)}  # fmt: skip
        self.class_names = paired.class_names
        self._cache: dict[tuple[str, str, int], tuple[int, float, str] | None] = {}
        self._by_class = np.argsort(self.labels, kind="stable")  # the images of each class, one slice each
        self._starts = np.searchsorted(self.labels[self._by_class], np.arange(len(self.class_names) + 1))
        self._index = {name: i for i, name in enumerate(self.class_names)}

    def kind(self, metric: str) -> str | None:
        """The paired test that judges `metric`: McNemar for a fraction of a set of images, the sign-flip test for
        another metric of the confusion matrix, None for anything else (the tolerance decides)."""
        if self.proportion_set(metric) is not None:
            return MCNEMAR
        return SIGN_FLIP if self._metric_of(metric) is not None else None

    def floor(self, metric: str, direction: str, allowed: float) -> float | None:
        """The smallest p of a loss beyond `allowed` that these predictions could give (Tarone's minimum attainable
        p, fixed by which images differ, not by who got them right); None when no such loss is possible: McNemar
        on d discordant images of a set of n needs d >= the smallest failing loss and then gives 0.5^d at best; the
        sign-flip test needs a differing image (2^-d)."""
        two = 2.0 if direction == "equal" else 1.0
        rows = self.proportion_set(metric)
        if rows is not None:
            right = [self.predicted[m][rows] == self.labels[rows] for m in ("candidate", "baseline")]
            d = int((right[0] != right[1]).sum())
            if d < smallest_failing_loss(allowed, len(rows)):
                return None
            return min(1.0, two * 0.5 ** min(d, 1074))
        d = int((self.predicted["candidate"] != self.predicted["baseline"]).sum())
        return None if d == 0 else min(1.0, two * 0.5 ** min(d, 1074))

    def test_at(self, metric: str, direction: str, level: float) -> tuple[int, float, str] | None:
        """`test` with the sign-flip test drawing swaps enough to reach `level` (McNemar is exact: no draws)."""
        resamples = PERMUTATION_RESAMPLES if self.kind(metric) == MCNEMAR else resamples_for(level)
        return self.test(metric, direction, resamples)

    def test(
        self, metric: str, direction: str, resamples: int = PERMUTATION_RESAMPLES
    ) -> tuple[int, float, str] | None:
        """(images, p, test) of the paired test that judges `metric` (`kind`), or None when the predictions do not
        give the metric; the sign-flip test draws up to `resamples` random swaps (`resamples_for` a level)."""
        key = (metric, direction, resamples)
        if key not in self._cache:
            rows = self.proportion_set(metric)
            if rows is not None:
                self._cache[key] = (*self.mcnemar(rows, direction), MCNEMAR)
            else:
                p = self.sign_flip_p(metric, direction, resamples)
                self._cache[key] = None if p is None else (len(self.labels), p, SIGN_FLIP)
        return self._cache[key]

    def proportion_set(self, metric: str) -> np.ndarray | None:
        """The images a McNemar metric is the fraction of (their indices), or None for other metrics."""
        if metric == "accuracy":
            return np.arange(len(self.labels))
        parts = metric.split(".")
        if len(parts) == 3 and parts[0] == "per_class" and parts[2] == "recall" and parts[1] in self._index:
            c = self._index[parts[1]]
            return self._by_class[self._starts[c] : self._starts[c + 1]]
        return None

    def mcnemar(self, rows: np.ndarray, direction: str) -> tuple[int, float]:
        """(images in the set, p) of McNemar's exact test of the candidate being worse on the images `rows`."""
        right = {model: predicted[rows] == self.labels[rows] for model, predicted in self.predicted.items()}
        lost, won = discordant(right["baseline"], right["candidate"])
        if direction == "lower":  # a fraction right where lower is better: gaining images is the worsening
            lost, won = won, lost
        return len(right["baseline"]), mcnemar_p(lost, won, two_sided=direction == "equal")

    def sign_flip_p(self, metric: str, direction: str, resamples: int = PERMUTATION_RESAMPLES) -> float | None:
        """The paired sign-flip permutation test's p of the candidate being worse on `metric` (`equal`: two-sided);
        None when the confusion matrix does not give the metric. Exact (every swap) when 2^d <= RESAMPLES + 1."""
        value = self._metric_of(metric)
        if value is None:
            return None
        candidate, baseline = self.predicted["candidate"], self.predicted["baseline"]
        differ = candidate != baseline
        d = int(differ.sum())
        if d == 0:
            return 1.0  # the two are the same on every image: no swap changes anything
        classes = max(len(self.class_names), 1)
        labels, ours, theirs = self.labels[differ], candidate[differ], baseline[differ]
        # A swap moves an image's two predictions between the models, so per class the two models' true positives
        # (and predictions) add up to the same totals in every swap: the baseline's are the totals less ours.
        right = {m: np.bincount(self.labels, weights=(p == self.labels).astype(np.float64), minlength=classes)
                 for m, p in self.predicted.items()}  # fmt: skip
        tp_total = right["candidate"] + right["baseline"]
        predicted_total = np.bincount(candidate, minlength=classes) + np.bincount(baseline, minlength=classes)
        tp_fixed = right["candidate"] - np.bincount(labels, weights=(ours == labels).astype(np.float64),
                                                    minlength=classes)  # fmt: skip
        predicted_fixed = np.bincount(candidate, minlength=classes) - np.bincount(ours, minlength=classes)
        support = np.bincount(self.labels, minlength=classes).astype(np.float64)

        def statistic(x: np.ndarray, y: np.ndarray | None, axis: int = -1) -> np.ndarray:  # y: x's complement
            rows = np.atleast_2d(x).astype(np.int64)  # (swaps, d): the candidate's predictions of the d images
            tp = tp_fixed + _per_row_counts(rows, classes, rows == labels)
            predicted = predicted_fixed + _per_row_counts(rows, classes)
            delta = value(tp, predicted, support) - value(tp_total - tp, predicted_total - predicted, support)
            return delta if np.ndim(x) > 1 else delta[0]

        alternative = {"higher": "less", "lower": "greater", "equal": "two-sided"}[direction]
        if d == 1:  # scipy's test needs two images: the two arrangements by hand, as its exact branch counts them
            observed, swapped = statistic(np.stack([ours, theirs]), None)
            tie = abs(np.finfo(np.float64).eps * 100 * observed)
            less, greater = (1 + (swapped <= observed + tie)) / 2, (1 + (swapped >= observed - tie)) / 2
            return float({"less": less, "greater": greater, "two-sided": min(1.0, 2 * min(less, greater))}[alternative])
        kwargs = {"permutation_type": "samples", "vectorized": True, "alternative": alternative}
        data, batch = (ours, theirs), max(1, _CHUNK // d)
        if d < 60 and 2**d <= resamples + 1 or direction == "equal":  # every swap, or no early stop
            from scipy.stats import permutation_test  # here: importing scipy.stats costs every no-op repro 0.5 s

            result = permutation_test(data, statistic, n_resamples=resamples, batch=batch,
                                      rng=PERMUTATION_SEED, **kwargs)  # fmt: skip
            return float(min(1.0, result.pvalue))
        # Random swaps, drawn here: scipy's random branch of permutation_type="samples" loops in Python over the d
        # images (seconds per batch at d = 100,000). Besag & Clifford (1991), sequential Monte Carlo p-values: draw
        # until STOP_AFTER swaps are at least as bad for the candidate as the observed one, at the l-th: p =
        # STOP_AFTER / l (a valid p-value); else, after `resamples`, (bad + 1) / (resamples + 1) as
        # scipy gives it. Equal models stop within a few dozen swaps.
        observed = float(statistic(ours, theirs))
        tie = abs(np.finfo(np.float64).eps * 100 * observed)  # scipy's tolerance for theoretically equal values
        rng, seen, bad, size = np.random.default_rng(PERMUTATION_SEED), 0, 0, 64
        while seen < resamples:
            size = min(size, resamples - seen, batch)
            drawn = statistic(np.where(rng.random((size, d)) < 0.5, theirs, ours), None)
            worse = drawn <= observed + tie if alternative == "less" else drawn >= observed - tie
            count = bad + np.cumsum(worse)
            stop = np.flatnonzero(count >= STOP_AFTER)
            if stop.size:
                return STOP_AFTER / (seen + int(stop[0]) + 1)
            bad, seen, size = int(count[-1]), seen + size, size * 4
        return (bad + 1) / (resamples + 1)

    def _metric_of(self, metric: str) -> Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray] | None:
        """(true positives, predictions, support) per class, (rows, classes) -> the metric per row; None when the
        confusion matrix does not give it."""
        parts = metric.split(".")
        if metric in _MACRO:
            name, index = metric.removeprefix("macro_"), None
        elif len(parts) == 3 and parts[0] == "per_class" and parts[1] in self.class_names and parts[2] in (
            "precision", "recall", "f1"):  # fmt: skip
            name, index = parts[2], self.class_names.index(parts[1])
        else:
            return None
        images = max(len(self.labels), 1)

        def value(true_pos: np.ndarray, predicted: np.ndarray, support: np.ndarray) -> np.ndarray:
            if name == "accuracy":
                return true_pos.sum(axis=1) / images
            support = np.broadcast_to(support, true_pos.shape)
            precision = np.divide(true_pos, predicted, out=np.zeros(true_pos.shape), where=predicted > 0)
            recall = np.divide(true_pos, support, out=np.zeros(true_pos.shape), where=support > 0)
            denom = precision + recall
            f1 = np.divide(2 * precision * recall, denom, out=np.zeros(true_pos.shape), where=denom > 0)
            per_class = {"precision": precision, "recall": recall, "f1": f1}[name]
            return per_class.mean(axis=1) if index is None else per_class[:, index]

        return value


def _per_row_counts(values: np.ndarray, classes: int, where: np.ndarray | None = None) -> np.ndarray:
    """(rows, n) class indices -> (rows, classes) counts of each class per row (only where `where`)."""
    rows = values.shape[0]
    flat = (values + (np.arange(rows) * classes)[:, None]).ravel()
    weights = None if where is None else where.ravel().astype(np.float64)
    return np.bincount(flat, weights=weights, minlength=rows * classes).reshape(rows, classes)
