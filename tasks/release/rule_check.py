"""One gate rule on one concrete key: its value against the baseline's, its tolerance, and (given both models'
predictions) its paired test at the level its place in the family gives it, or why it cannot be judged. Pure.
The rules as a family, and the verdict, are tasks/release/verdict.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tasks.core.params import Rule
from tasks.release.paired import (
    EPS,
    MCNEMAR,
    PairedStats,
    images_needed,
    judgeable,
    resamples_for,
    sign_flip_floor,
)

Value = float | str

TOLERANCE = "tolerance only"


@dataclass(frozen=True)
class RuleResult:
    rule: str  # the rule as written (may hold *); `metric` is the concrete key it was checked on
    metric: str
    direction: str
    value: Value | None
    baseline: Value | None
    delta: float | None
    allowed: float | None
    passed: bool  # False: this row fails the verdict (a row not judged does not, unless regression.unjudged: fail)
    reason: str
    n: int | None = None  # images the paired test ran on (None: no paired test)
    p_value: float | None = None  # one-sided p of "the candidate is worse" (two-sided for `equal`)
    test: str = ""  # McNemar | sign-flip | tolerance only; "" without per-image predictions
    judged: bool = True  # False: its test cannot reach the highest level the family could give it, on its images
    p_adjusted: float | None = None  # weighted Holm's adjusted p over the family: < alpha fails
    needs: int | None = None  # test images it would need to be judged (None: judged, or no number is enough)

    def describe(self) -> str:
        """One line a person can act on: the metric, its value, the baseline and the delta."""
        if self.delta is None:
            return f"{self.metric}: {self.reason} (value {cell(self.value)}, baseline {cell(self.baseline)})"
        return (
            f"{self.metric}: {cell(self.value)} vs baseline {cell(self.baseline)} "
            f"(delta {self.delta:+.4f}, {self.direction} is better, allowed {cell(self.allowed)}): {self.reason}"
        )

    def shortfall(self) -> str:
        """`per_class.cat.recall: 96 test images, needs 140`: why an unjudged rule was not judged, briefly."""
        needs = f"needs {self.needs}" if self.needs else "no number is enough (its reason in regression.json)"
        return f"{self.metric}: {self.n} test images, {needs}"


def lookup(metrics: Mapping[str, Any], dotted: str) -> Value | None:
    """metrics['per_class']['cat']['recall'] for 'per_class.cat.recall'; None when absent or not a leaf."""
    node: Any = metrics
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    if isinstance(node, bool):
        return None
    if isinstance(node, int | float):
        return float(node)
    return node if isinstance(node, str) else None


def expand(pattern: str, reference: Mapping[str, Any]) -> list[str]:
    """The concrete keys of `reference` that `pattern` matches (`*` = any one key), sorted."""
    keys = [""]
    for part in pattern.split("."):
        grown = []
        for prefix in keys:
            node = _node(reference, prefix)
            if not isinstance(node, Mapping):
                continue
            names = sorted(node) if part == "*" else [part] if part in node else []
            grown += [f"{prefix}.{name}" if prefix else name for name in names]
        keys = grown
    return keys


def _node(tree: Mapping[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split(".") if dotted else []:
        node = node.get(part) if isinstance(node, Mapping) else None
    return node


# -- one rule ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Standing:
    """A paired rule's place in the gate's family (tasks/release/verdict.py, family.py)."""

    weight: float  # its share of alpha (Tarone's selection, weighted Holm); 0: out of the family, it cannot fail
    adjusted: float  # its weighted-Holm adjusted p over the family (1.0 out of it)
    family: int  # rules in the family
    floor: float | None  # the smallest p a loss beyond its tolerance could give on these predictions; None: none
    best: float  # the largest weight its group lets it have: the level `judged` asks its test to be able to reach

    @classmethod
    def alone(cls, p: float, floor: float | None) -> Standing:
        return cls(weight=1.0, adjusted=p, family=1, floor=floor, best=1.0)


def tolerance(rule: Rule, metrics: Mapping[str, Any], baseline: Mapping[str, Any], metric: str) -> float | None:
    """The worsening `rule` allows on `metric`, max(abs_tol, rel_tol x |baseline|); None unless both are finite
    numbers (then check_rule fails or compares them without a paired test)."""
    value, base = lookup(metrics, metric), lookup(baseline, metric)
    if not isinstance(value, float) or not isinstance(base, float) or not math.isfinite(value + base):
        return None
    return round(max(rule.abs_tol, rule.rel_tol * abs(base)), 6)


def check_rule(
    rule: Rule,
    metrics: Mapping[str, Any],
    baseline: Mapping[str, Any],
    metric: str = "",
    *,
    stats: PairedStats | None = None,
    alpha: float = 0.05,
    standing: Standing | None = None,
) -> RuleResult:
    """Check one rule on one concrete key (`metric`, default: the rule's own key); with `stats`, a worsening
    beyond the tolerance fails only when the paired test finds it significant: its adjusted p in the family
    (`standing`; default: the rule alone, its own p) < alpha."""
    metric = metric or rule.metric
    value, base = lookup(metrics, metric), lookup(baseline, metric)
    test = TOLERANCE if stats is not None else ""

    def result(delta: float | None, allowed: float | None, passed: bool, reason: str, **paired: Any) -> RuleResult:
        return RuleResult(rule.metric, metric, rule.direction, value, base, delta, allowed, passed, reason,
                          **{"test": test, **paired})  # fmt: skip

    if value is None or base is None:
        where = "this run's metrics" if value is None else "the baseline"
        return result(None, None, False, f"missing from {where}")
    if isinstance(value, str) or isinstance(base, str):
        if rule.direction != "equal":
            return result(None, None, False, "not a number; only direction 'equal' compares text")
        same = value == base
        return result(None, None, same, "ok" if same else "differs from the baseline")
    if not (math.isfinite(value) and math.isfinite(base)):
        return result(None, None, False, "not a finite number")
    allowed = round(max(rule.abs_tol, rule.rel_tol * abs(base)), 6)
    delta = value - base
    worsening = {"higher": -delta, "lower": delta, "equal": abs(delta)}[rule.direction]
    beyond = worsening > allowed + EPS
    what = "differs" if rule.direction == "equal" else "worse"
    excess = f"{what} by {worsening:.6g}, more than the {allowed:.6g} allowed"
    kind = stats.kind(metric) if stats is not None else None
    if kind is None:  # no per-image predictions, or not a metric of them (loss, a hash): the tolerance decides
        return result(round(delta, 6), allowed, not beyond, excess if beyond else "ok")

    two_sided = rule.direction == "equal"
    level = alpha * (standing.weight or standing.best) if standing is not None else alpha
    tested = stats.test_at(metric, rule.direction, level)
    if standing is None:
        standing = Standing.alone(tested[1], stats.floor(metric, rule.direction, allowed))
    n, p, name = tested
    held, level = standing.adjusted, alpha * standing.weight
    if standing.family == 1:
        shown = f"p {p:.2g}"
    else:
        shown = f"p {p:.2g}, weighted-Holm-adjusted over {standing.family} rules {held:.2g}"
    # No image differing enough to lose beyond the tolerance (Tarone's floor None) is a certain pass, judged; else
    # a rule is judged when its test could reach the highest level the family can give it on its images.
    judged, needs, short = (True, None, "") if standing.floor is None else _judgeable(
        name, allowed, n, alpha, standing.best, two_sided)  # fmt: skip
    paired = {"test": name, "n": n, "p_value": float(f"{p:.4g}"), "p_adjusted": float(f"{held:.4g}")}
    if beyond and standing.weight > 0 and held < alpha:
        return result(round(delta, 6), allowed, False, f"{excess} ({shown} < alpha {alpha:g})", **paired)
    if not judged:
        return result(round(delta, 6), allowed, True, short, judged=False, needs=needs, **paired)
    if beyond and standing.weight > 0:
        return result(round(delta, 6), allowed, True, f"{excess}, within chance ({shown} >= alpha {alpha:g})",
                      **paired)  # fmt: skip
    if beyond:  # Tarone: the images the two models disagree on cannot give a p below any level it could hold
        floor = f"p {standing.floor:.2g} at best" if standing.floor is not None else "no p"
        return result(round(delta, 6), allowed, True, f"{excess}, within chance (the images the two models "
                      f"disagree on can give {floor}, not below its share of alpha {alpha:g}; p {p:.2g})",
                      **paired)  # fmt: skip
    return result(round(delta, 6), allowed, True, "ok", **paired)


def _judgeable(test: str, allowed: float, n: int, alpha: float, best: float, two_sided: bool,
               ) -> tuple[bool, int | None, str]:  # fmt: skip
    """(judged, images it would need, why not) of a rule whose test on `n` images must be able to reach alpha x
    best, the highest level the family can give it (when its loss is all the models' disagreement)."""
    level = alpha * best
    at = f"p < alpha x {best:.3g} = {level:.3g}" if best < 1 else f"p < alpha = {level:g}"
    if test == MCNEMAR:
        if judgeable(allowed, n, level, two_sided=two_sided):
            return True, None, ""
        needs = images_needed(allowed, level, two_sided=two_sided)
        if needs is None:
            return False, None, f"cannot be judged: no number of images lets a loss just beyond {allowed:g} reach {at}"
        return False, needs, f"too few images to judge: {n}, needs {needs} (for {at})"
    floor = sign_flip_floor(n, two_sided=two_sided, resamples=resamples_for(level))
    if floor < level:
        return True, None, ""
    return False, None, f"cannot be judged: the sign-flip test's smallest p on {n} images is {floor:.2g}, not {at}"


def cell(x: Value | None) -> str:
    """A value as a table cell: '-' when absent, text cut to 16 characters, a number to 4 places."""
    if x is None:
        return "-"
    if isinstance(x, str):
        return x if len(x) <= 16 else x[:12] + "..."
    return f"{x:.4f}"
