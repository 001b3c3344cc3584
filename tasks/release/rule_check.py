"""One gate rule on one concrete key: its value against the baseline's, its tolerance, and (given both models'
predictions) its paired test at the level Holm's correction gives it, or why it cannot be judged. Pure.
The rules as a family, and the verdict, are tasks/release/verdict.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tasks.core.params import Rule
from tasks.release.family import strictest_level
from tasks.release.paired import EPS, MCNEMAR, PairedStats, images_needed, judgeable, sign_flip_floor

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
    judged: bool = True  # False: its test cannot reach Holm's strictest level, and no significant loss was seen
    p_adjusted: float | None = None  # Holm's adjusted p over the verdict's paired rules: < alpha fails
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


def check_rule(
    rule: Rule,
    metrics: Mapping[str, Any],
    baseline: Mapping[str, Any],
    metric: str = "",
    *,
    stats: PairedStats | None = None,
    alpha: float = 0.05,
    family: int = 1,
    adjusted: float | None = None,
) -> RuleResult:
    """Check one rule on one concrete key (`metric`, default: the rule's own key); with `stats`, a worsening
    beyond the tolerance fails only when the paired test finds it significant: `adjusted` (its Holm-adjusted p in
    a family of `family` paired rules; default its own p) < alpha."""
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
    tested = stats.test(metric, rule.direction) if stats is not None else None
    if tested is None:  # no per-image predictions, or not a metric of them (loss, a hash): the tolerance decides
        return result(round(delta, 6), allowed, not beyond, excess if beyond else "ok")

    n, p, name = tested
    held = p if adjusted is None else adjusted
    shown = f"p {p:.2g}" if family == 1 else f"p {p:.2g}, Holm-adjusted over {family} rules {held:.2g}"
    judged, needs, short = _judgeable(name, allowed, n, alpha, family, rule.direction == "equal")
    paired = {"test": name, "n": n, "p_value": float(f"{p:.4g}"), "p_adjusted": float(f"{held:.4g}")}
    if beyond and held < alpha:
        return result(round(delta, 6), allowed, False, f"{excess} ({shown} < alpha {alpha:g})", **paired)
    if not judged:
        return result(round(delta, 6), allowed, True, short, judged=False, needs=needs, **paired)
    if beyond:
        return result(round(delta, 6), allowed, True, f"{excess}, within chance ({shown} >= alpha {alpha:g})",
                      **paired)  # fmt: skip
    return result(round(delta, 6), allowed, True, "ok", **paired)


def _judgeable(test: str, allowed: float, n: int, alpha: float, family: int, two_sided: bool,
               ) -> tuple[bool, int | None, str]:  # fmt: skip
    """(judged, images it would need, why not) of a rule whose test on `n` images must be able to reach alpha /
    family, the strictest level Holm may hold it to."""
    level = strictest_level(alpha, family)
    at = f"p < alpha / {family} = {level:.3g}" if family > 1 else f"p < alpha = {level:g}"
    if test == MCNEMAR:
        if judgeable(allowed, n, level, two_sided=two_sided):
            return True, None, ""
        needs = images_needed(allowed, level, two_sided=two_sided)
        if needs is None:
            return False, None, f"cannot be judged: no number of images lets a loss just beyond {allowed:g} reach {at}"
        return False, needs, f"too few images to judge: {n}, needs {needs} (for {at})"
    floor = sign_flip_floor(n, two_sided=two_sided)
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
