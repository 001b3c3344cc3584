"""The regression comparator: metrics vs a baseline under rules with direction, tolerance and a paired test. Pure.

A rule names a dotted key (`per_class.cat.recall`); `*` stands for every key at its level in the
baseline (`per_class.*.recall`: every class the baseline knows). `higher`/`lower` allow a worsening
of max(abs_tol, rel_tol x |baseline|); `equal` demands the same value (strings such as a hash, or
numbers within the tolerance). Anything missing or not finite fails: a gate never skips a rule.

Given both models' predictions on the same images (`Paired`, tasks/release/paired.py), a worsening beyond the
tolerance fails only when a one-sided paired test (McNemar's exact test, or a paired bootstrap) says it is not
chance (p < alpha); a rule on too few images to judge does not fail the verdict. Anything else (loss, a hash)
is compared on the tolerance alone, and the table (tasks/release/verdict_table.py) says so.
Without per-image predictions (the nightly flow's comparison with baseline/metrics.json) every rule is judged on
its tolerance alone, as before.

The verdict also carries the export's deferred gates (INT8 vs fp32 ONNX): limits from params.yaml,
not a baseline, but a model whose INT8 copy fails them is not releasable either.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from tasks.core.params import Rule
from tasks.release.paired import EPS, Paired, PairedStats, judgeable
from tasks.release.parity import Check

Value = float | str

MCNEMAR, BOOTSTRAP, TOLERANCE = "McNemar", "bootstrap", "tolerance only"


@dataclass(frozen=True)
class RuleResult:
    rule: str  # the rule as written (may hold *); `metric` is the concrete key it was checked on
    metric: str
    direction: str
    value: Value | None
    baseline: Value | None
    delta: float | None
    allowed: float | None
    passed: bool  # False: this row fails the verdict (a row too small to judge does not)
    reason: str
    n: int | None = None  # images the paired test ran on (None: no paired test)
    p_value: float | None = None  # one-sided p of "the candidate is worse" (two-sided for `equal`)
    test: str = ""  # McNemar | bootstrap | tolerance only; "" without per-image predictions
    judged: bool = True  # False: too few images to detect the tolerance, and no significant loss seen

    def describe(self) -> str:
        """One line a person can act on: the metric, its value, the baseline and the delta."""
        if self.delta is None:
            return f"{self.metric}: {self.reason} (value {cell(self.value)}, baseline {cell(self.baseline)})"
        return (
            f"{self.metric}: {cell(self.value)} vs baseline {cell(self.baseline)} "
            f"(delta {self.delta:+.4f}, {self.direction} is better, allowed {cell(self.allowed)}): {self.reason}"
        )


@dataclass(frozen=True)
class Verdict:
    passed: bool
    has_baseline: bool
    results: tuple[RuleResult, ...]
    gates: tuple[Check, ...] = ()
    mismatch: str = ""  # the baseline could not be compared on this run's test set: why, and what to do
    alpha: float | None = None  # the paired test's level; None: no per-image predictions, tolerance only
    baseline_note: str = ""  # how the baseline side was scored ("baseline re-scored on today's test set: ...")

    @property
    def status(self) -> str:
        """pass | regression | different test set | no baseline: one word for tables and dvc exp show."""
        if self.mismatch:
            return "different test set"
        if not self.passed:
            return "regression"
        return "pass" if self.has_baseline else "no baseline"

    @property
    def too_few(self) -> tuple[RuleResult, ...]:
        return tuple(r for r in self.results if not r.judged)

    def summary(self) -> str:
        """The verdict in one line a person can act on."""
        if self.mismatch:
            return self.mismatch
        note = f"; {self.baseline_note}" if self.baseline_note else ""
        if not self.passed:
            names = ", ".join(dict.fromkeys(r.metric if isinstance(r, RuleResult) else r.name for r in self.failures))
            return f"REGRESSION: {names} failed" + (" against the baseline" if self.has_baseline else "") + note
        if not self.has_baseline:
            return "no baseline yet: nothing to compare against; run `make promote` to make this run the baseline"
        held = len(self.results) - len(self.too_few)
        few = f" ({len(self.too_few)} more: too few images to judge)" if self.too_few else ""
        return f"PASS: {held} rule(s) and {len(self.gates)} export gate(s) hold against the baseline{few}{note}"

    @property
    def failures(self) -> tuple[RuleResult | Check, ...]:
        return tuple(r for r in (*self.results, *self.gates) if not r.passed)

    def with_gates(self, gates: Sequence[Check]) -> Verdict:
        """This verdict plus export gates: it passes only when they all pass too."""
        return replace(self, passed=self.passed and all(g.passed for g in gates), gates=tuple(gates))

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.status,
            "summary": self.summary(),
            "passed": self.passed,
            "has_baseline": self.has_baseline,
            "alpha": self.alpha,
            "baseline_note": self.baseline_note,
            "too_few_to_judge": [r.metric for r in self.too_few],
            "rules": [asdict(r) for r in self.results],
            "export_gates": [g.to_json() for g in self.gates],
        }


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
) -> RuleResult:
    """Check one rule on one concrete key (`metric`, default: the rule's own key); with `stats`, a worsening
    beyond the tolerance fails only when the paired test finds it significant (p < alpha)."""
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
    if stats is None:
        return result(round(delta, 6), allowed, not beyond, excess if beyond else "ok")

    mask = stats.proportion_set(metric)
    if mask is not None:
        n, p = stats.mcnemar(mask, rule.direction)
        judged, paired = judgeable(allowed, n, alpha, two_sided=rule.direction == "equal"), {"test": MCNEMAR}
    else:
        n, p, judged, paired = len(stats.labels), stats.bootstrap_p(metric, rule.direction), True, {"test": BOOTSTRAP}
        if p is None:  # not a metric of the predictions (loss, a hash): the tolerance alone decides
            return result(round(delta, 6), allowed, not beyond, excess if beyond else "ok")
    paired.update(n=n, p_value=float(f"{p:.4g}"))
    if beyond and p < alpha:
        return result(round(delta, 6), allowed, False, f"{excess} (p {p:.2g} < alpha {alpha:g})", **paired)
    if not judged:
        return result(round(delta, 6), allowed, True, f"too few images to judge (n={n})", judged=False, **paired)
    if beyond:
        return result(round(delta, 6), allowed, True, f"{excess}, within chance (p {p:.2g} >= alpha {alpha:g})",
                      **paired)  # fmt: skip
    return result(round(delta, 6), allowed, True, "ok", **paired)


# -- the verdict -------------------------------------------------------------------------------------------------


def _test_set(metrics: Mapping[str, Any]) -> tuple[str, int, tuple[str, ...]]:
    """(test set hash, images, class names) of a metrics dict, as score_split and make promote write them."""
    per_class = metrics.get("per_class")
    classes = tuple(sorted(per_class)) if isinstance(per_class, Mapping) else ()
    return str(metrics.get("test_set_sha256")), int(metrics.get("num_samples") or 0), classes


def describe_test_set(metrics: Mapping[str, Any]) -> str:
    """`963 images, 10 classes (circle, crescent, ...), test set sha256 eb48cd1ff731` for a metrics dict."""
    digest, images, classes = _test_set(metrics)
    names = ", ".join(classes[:5]) + (f", ... ({len(classes) - 5} more)" if len(classes) > 5 else "")
    return f"{images} images, {len(classes)} classes ({names}), test set sha256 {digest[:12]}"


def mismatch(metrics: Mapping[str, Any], baseline: Mapping[str, Any]) -> str:
    """For a baseline known only by its recorded metrics: empty when run and baseline were scored on the same test
    images and classes; else one line naming both and what to do. Rules compare models on one test set; across
    test sets they only produce a wall of `missing`/`differs` lines that say nothing about either model."""
    if "test_set_sha256" not in metrics or "test_set_sha256" not in baseline:
        return ""  # nothing says which test set: compared rule by rule
    ours, theirs = _test_set(metrics), _test_set(baseline)
    if ours[0] == theirs[0] and ours[2] == theirs[2]:
        return ""
    return (
        f"different test set: the baseline was scored on {describe_test_set(baseline)}; this run on "
        f"{describe_test_set(metrics)}. The rules compare models on the same test images: to gate models of this "
        'data, promote one of them, saying why (`make promote ACCEPT="<why>"`); to compare with the baseline, '
        "train on its data"
    )


def compare(
    metrics: Mapping[str, Any],
    baseline: Mapping[str, Any] | None,
    rules: Sequence[Rule],
    *,
    paired: Paired | None = None,
    alpha: float = 0.05,
    baseline_note: str = "",
) -> Verdict:
    """Every rule checked; with no baseline at all the verdict passes and says so.

    With `paired` (both models' predictions on the same images, `baseline` the baseline's metrics on them), each
    rule also gets its paired test at level `alpha`. Without it, a baseline scored on another test set (or class
    set) fails as one `different test set` line instead of rule by rule."""
    if baseline is None:
        return Verdict(passed=True, has_baseline=False, results=())
    stats = PairedStats(paired) if paired is not None else None
    if stats is None:
        different = mismatch(metrics, baseline)
        if different:
            return Verdict(passed=False, has_baseline=True, results=(), mismatch=different,
                           baseline_note=baseline_note)  # fmt: skip
    results: list[RuleResult] = []
    for rule in rules:
        keys = expand(rule.metric, baseline) if "*" in rule.metric else [rule.metric]
        if not keys:
            results.append(RuleResult(rule.metric, rule.metric, rule.direction, None, None, None, None, False,
                                      "matches nothing in the baseline"))  # fmt: skip
        results += [check_rule(rule, metrics, baseline, key, stats=stats, alpha=alpha) for key in keys]
    return Verdict(passed=all(r.passed for r in results), has_baseline=True, results=tuple(results),
                   alpha=alpha if stats is not None else None, baseline_note=baseline_note)  # fmt: skip


def cell(x: Value | None) -> str:
    """A value as a table cell: '-' when absent, text cut to 16 characters, a number to 4 places."""
    if x is None:
        return "-"
    if isinstance(x, str):
        return x if len(x) <= 16 else x[:12] + "..."
    return f"{x:.4f}"
