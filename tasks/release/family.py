"""The gate's paired rules as one family: which rules are in it (Tarone), their shares of alpha, and the weighted
Holm step-down over them, so that two equal models fail the gate (any rule) in at most alpha of runs whatever the
number of rules, and a rule that cannot fail does not dilute the ones that can. Pure.

- Tarone (1990): a discrete test has a smallest p it can give, here fixed by the images the two models predict
  differently (`PairedStats.floor`: 0.5^d for McNemar on d discordant images, 2^-d for the sign-flip test). A
  rule whose smallest p is not below its level can never be significant: it leaves the family, which raises the
  others' levels; repeated until every rule left can reach its own. Under "equal models" the swaps of each image's
  two predictions are fair coins given which images differ, so a choice made from the d's alone keeps each test
  exact and the family-wise bound below (Hommel & Krummenauer 1998 for Tarone with Holm's step-down).
- Weights: the rules over the whole test set (accuracy, the macro metrics) share `whole_share` of alpha, the
  per-class rules the rest, within each group in proportion to each rule's `weight` (params.yaml: accuracy 3,
  macro_f1 1, bench/bench_gate.py measured it); a group with no rule in the family gives its share to the other.
  A 4-point loss over 500 images is then judged near alpha, not at alpha / (classes + 2).
- Weighted Holm (Holm 1979): order the rules by p / w; the j-th is held to alpha x w_j / (the weights of it and
  every rule after it), and the steps stop at the first that is not below its level. As adjusted p-values:
  p'_(j) = max over l <= j of min(1, p_(l) / w_(l) x W_l), W_l the weights from l on; significant when p' < alpha.
  It needs no assumption on how the tests depend on each other (accuracy and the recalls share images).
"""

from __future__ import annotations

from collections.abc import Sequence

WHOLE, CLASS = "whole test set", "one class"


def shares(
    members: Sequence[bool], groups: Sequence[str], relative: Sequence[float], whole_share: float
) -> list[float]:
    """Each rule's weight (0 outside the family): its group's share of 1, split among the group's members in
    proportion to `relative` (each rule's `weight` in params.yaml)."""
    total = {
        g: sum(r for m, h, r in zip(members, groups, relative, strict=True) if m and h == g) for g in (WHOLE, CLASS)
    }
    share = {WHOLE: whole_share, CLASS: 1 - whole_share} if all(total.values()) else {WHOLE: 1.0, CLASS: 1.0}
    return [share[g] * r / total[g] if m else 0.0 for m, g, r in zip(members, groups, relative, strict=True)]


def tarone_weights(
    floors: Sequence[float | None], groups: Sequence[str], relative: Sequence[float], alpha: float, whole_share: float
) -> list[float]:
    """The family's weights: a rule stays while its smallest possible p (`floors`; None: it cannot fail at all)
    is below alpha x its weight, recomputed as rules leave until none does."""
    members = [f is not None for f in floors]
    while True:
        weights = shares(members, groups, relative, whole_share)
        kept = [m and f is not None and f < alpha * w for m, f, w in zip(members, floors, weights, strict=True)]
        if kept == members:
            return weights
        members = kept


def best_weights(groups: Sequence[str], relative: Sequence[float], whole_share: float) -> list[float]:
    """The largest weight each rule can have: a whole-test-set rule beside the other whole-test-set rules, no class
    rule in the family; a class rule alone in its group (its images' disagreement is the accuracy rule's too, so
    the whole-test-set group is never empty beside it)."""
    whole = sum(r for g, r in zip(groups, relative, strict=True) if g == WHOLE)
    return [r / whole if g == WHOLE else 1 - whole_share for g, r in zip(groups, relative, strict=True)]


def weighted_holm(p_values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """Weighted Holm's adjusted p-values, in the order given, for rules of weight > 0 (1.0 for the others):
    p' < alpha exactly when the weighted step-down at alpha rejects."""
    inside = [i for i, w in enumerate(weights) if w > 0]
    order = sorted(inside, key=lambda i: p_values[i] / weights[i])
    adjusted = [1.0] * len(p_values)
    remaining = sum(weights[i] for i in inside)
    running = 0.0
    for i in order:
        running = max(running, min(1.0, p_values[i] / weights[i] * remaining))
        adjusted[i] = running
        remaining -= weights[i]
    return adjusted
