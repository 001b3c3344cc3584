"""The gate's paired rules as one family: Holm's step-down adjusted p-values, so that two equal models fail the
gate (any rule) in at most alpha of runs, whatever the number of classes. Pure.

Holm (1979): sort the m p-values; the i-th smallest (from 1) is held to alpha / (m - i + 1), and the steps stop at
the first that is not below its level. As adjusted p-values: p'_(i) = max over j <= i of min(1, (m - j + 1) p_(j));
a rule is significant when p' < alpha. It needs no assumption on how the tests depend on each other (accuracy
and the per-class recalls share images). A rule's level is never stricter than alpha / m: `images_needed` and
`judgeable` (tasks/release/paired.py) ask a rule to be able to reach that level.
"""

from __future__ import annotations

from collections.abc import Sequence


def holm_adjusted(p_values: Sequence[float]) -> list[float]:
    """Holm's adjusted p-values, in the order given: p' < alpha exactly when Holm's step-down at alpha rejects."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [1.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def strictest_level(alpha: float, family: int) -> float:
    """The lowest level Holm may hold a rule of a family of `family` to: alpha / family (its first step)."""
    return alpha / max(family, 1)
