"""Gate verdicts on hand-built predictions: metrics as scoring computes them, classes with planted losses and
gains, the default rules; for the gate's tests (tests/release/)."""

from __future__ import annotations

import numpy as np

from tasks.core.metrics import classification_metrics
from tasks.core.params import Rule
from tasks.release.paired import Paired
from tasks.release.verdict import RuleResult, Verdict, compare

RULES = [Rule(metric="accuracy", abs_tol=0.02), Rule(metric="macro_f1", abs_tol=0.02),
         Rule(metric="per_class.*.recall", abs_tol=0.05)]  # fmt: skip  # the defaults


def scored(labels: list[int], predicted: list[int], names: tuple[str, ...]) -> dict:
    """metrics.json's keys for these predictions, as scoring computes them."""
    logits = np.eye(len(names), dtype=np.float32)[predicted]
    return {**classification_metrics(logits, np.asarray(labels), names), "test_set_sha256": "t" * 64}


def paired_verdict(labels: list[int], candidate: list[int], baseline: list[int], names: tuple[str, ...],
                   rules: list[Rule] = RULES, alpha: float = 0.05) -> Verdict:  # fmt: skip
    return compare(scored(labels, candidate, names), scored(labels, baseline, names), rules,
                   paired=Paired(labels, candidate, baseline, names), alpha=alpha)  # fmt: skip


def by_metric(verdict: Verdict) -> dict[str, RuleResult]:
    return {r.metric: r for r in verdict.results}


def classes_with(n: int | list[int], counts: list[tuple[int, int]],
                 ) -> tuple[list[int], list[int], list[int], tuple[str, ...]]:  # fmt: skip
    """len(counts) classes of n images each (or n[i]); class i: the candidate loses counts[i][0] images the baseline
    got right (predicts the next class) and wins counts[i][1] the baseline missed; both get every other one right."""
    k = len(counts)
    sizes = n if isinstance(n, list) else [n] * k
    labels, candidate, baseline = [], [], []
    for c, ((losses, gains), n) in enumerate(zip(counts, sizes, strict=True)):
        wrong = (c + 1) % k
        labels += [c] * n
        candidate += [wrong] * losses + [c] * gains + [c] * (n - losses - gains)
        baseline += [c] * losses + [wrong] * gains + [c] * (n - losses - gains)
    return labels, candidate, baseline, tuple(f"c{i}" for i in range(k))
