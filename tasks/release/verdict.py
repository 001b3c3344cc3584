"""The regression comparator: metrics vs a baseline under rules with direction and tolerance. Pure.

A rule names a dotted key (`per_class.cat.recall`); `*` stands for every key at its level in the
baseline (`per_class.*.recall`: every class the baseline knows). `higher`/`lower` allow a worsening
of max(abs_tol, rel_tol x |baseline|); `equal` demands the same value (strings such as a hash, or
numbers within the tolerance). Anything missing or not finite fails: a gate never skips a rule.

The verdict also carries the export's deferred gates (INT8 vs fp32 ONNX): limits from params.yaml,
not a baseline, but a model whose INT8 copy fails them is not releasable either.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tasks.core.params import Rule
from tasks.release.parity import Check

Value = float | str


@dataclass(frozen=True)
class RuleResult:
    rule: str  # the rule as written (may hold *); `metric` is the concrete key it was checked on
    metric: str
    direction: str
    value: Value | None
    baseline: Value | None
    delta: float | None
    allowed: float | None
    passed: bool
    reason: str

    def describe(self) -> str:
        """One line a person can act on: the metric, its value, the baseline and the delta."""
        if self.delta is None:
            return f"{self.metric}: {self.reason} (value {_cell(self.value)}, baseline {_cell(self.baseline)})"
        return (
            f"{self.metric}: {_cell(self.value)} vs baseline {_cell(self.baseline)} "
            f"(delta {self.delta:+.4f}, {self.direction} is better, allowed {_cell(self.allowed)}): {self.reason}"
        )


@dataclass(frozen=True)
class Verdict:
    passed: bool
    has_baseline: bool
    results: tuple[RuleResult, ...]
    gates: tuple[Check, ...] = ()
    mismatch: str = ""  # the baseline was scored on other test images or classes: how they differ

    @property
    def status(self) -> str:
        """pass | regression | different test set | no baseline: one word for tables and dvc exp show."""
        if self.mismatch:
            return "different test set"
        if not self.passed:
            return "regression"
        return "pass" if self.has_baseline else "no baseline"

    def summary(self) -> str:
        """The verdict in one line a person can act on."""
        if self.mismatch:
            return self.mismatch
        if not self.passed:
            names = ", ".join(dict.fromkeys(r.metric if isinstance(r, RuleResult) else r.name for r in self.failures))
            return f"REGRESSION: {names} failed" + (" against the baseline" if self.has_baseline else "")
        if not self.has_baseline:
            return "no baseline yet: nothing to compare against; run `make promote` to make this run the baseline"
        return f"PASS: {len(self.results)} rule(s) and {len(self.gates)} export gate(s) hold against the baseline"

    @property
    def failures(self) -> tuple[RuleResult | Check, ...]:
        return tuple(r for r in (*self.results, *self.gates) if not r.passed)

    def with_gates(self, gates: Sequence[Check]) -> Verdict:
        """This verdict plus export gates: it passes only when they all pass too."""
        passed = self.passed and all(g.passed for g in gates)
        return Verdict(passed, self.has_baseline, self.results, tuple(gates), self.mismatch)

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.status,
            "summary": self.summary(),
            "passed": self.passed,
            "has_baseline": self.has_baseline,
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


def check_rule(rule: Rule, metrics: Mapping[str, Any], baseline: Mapping[str, Any], metric: str = "") -> RuleResult:
    """Check one rule on one concrete key (`metric`, default: the rule's own key)."""
    metric = metric or rule.metric
    value, base = lookup(metrics, metric), lookup(baseline, metric)

    def result(delta: float | None, allowed: float | None, passed: bool, reason: str) -> RuleResult:
        return RuleResult(rule.metric, metric, rule.direction, value, base, delta, allowed, passed, reason)

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
    passed = worsening <= allowed + 1e-12
    reason = "ok" if passed else f"worse by {worsening:.6g}, more than the {allowed:.6g} allowed"
    if not passed and rule.direction == "equal":
        reason = f"differs by {worsening:.6g}, more than the {allowed:.6g} allowed"
    return result(round(delta, 6), allowed, passed, reason)


def _test_set(metrics: Mapping[str, Any]) -> tuple[str, int, tuple[str, ...]]:
    """(test set hash, images, class names) of a metrics dict, as score_split and make promote write them."""
    per_class = metrics.get("per_class")
    classes = tuple(sorted(per_class)) if isinstance(per_class, Mapping) else ()
    return str(metrics.get("test_set_sha256")), int(metrics.get("num_samples") or 0), classes


def _describe_test_set(test_set: tuple[str, int, tuple[str, ...]]) -> str:
    digest, images, classes = test_set
    names = ", ".join(classes[:5]) + (f", ... ({len(classes) - 5} more)" if len(classes) > 5 else "")
    return f"{images} images, {len(classes)} classes ({names}), test set sha256 {digest[:12]}"


def mismatch(metrics: Mapping[str, Any], baseline: Mapping[str, Any]) -> str:
    """Empty when run and baseline were scored on the same test images and classes; else one line
    naming both and what to do. Rules compare models on one test set; across test sets they only
    produce a wall of `missing`/`differs` lines that say nothing about either model."""
    if "test_set_sha256" not in metrics or "test_set_sha256" not in baseline:
        return ""  # nothing says which test set: compared rule by rule
    ours, theirs = _test_set(metrics), _test_set(baseline)
    if ours[0] == theirs[0] and ours[2] == theirs[2]:
        return ""
    return (
        f"different test set: the baseline was scored on {_describe_test_set(theirs)}; this run on "
        f"{_describe_test_set(ours)}. The rules compare models on the same test images: to gate models of this "
        f"data, promote one of them (`make promote`); to compare with the baseline, train on its data"
    )


def compare(metrics: Mapping[str, Any], baseline: Mapping[str, Any] | None, rules: Sequence[Rule]) -> Verdict:
    """Every rule checked; with no baseline at all the verdict passes and says so. A baseline scored on
    another test set (or class set) fails as one `different test set` line instead of rule by rule."""
    if baseline is None:
        return Verdict(passed=True, has_baseline=False, results=())
    different = mismatch(metrics, baseline)
    if different:
        return Verdict(passed=False, has_baseline=True, results=(), mismatch=different)
    results: list[RuleResult] = []
    for rule in rules:
        keys = expand(rule.metric, baseline) if "*" in rule.metric else [rule.metric]
        if not keys:
            results.append(RuleResult(rule.metric, rule.metric, rule.direction, None, None, None, None, False,
                                      "matches nothing in the baseline"))  # fmt: skip
        results += [check_rule(rule, metrics, baseline, key) for key in keys]
    return Verdict(passed=all(r.passed for r in results), has_baseline=True, results=tuple(results))


def _cell(x: Value | None) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x if len(x) <= 16 else x[:12] + "..."
    return f"{x:.4f}"


def format_table(verdict: Verdict, *, markdown: bool = False) -> str:
    """The verdict as an aligned text table (or a Markdown table), one row per checked key."""
    outcome = "verdict: " + ("PASS" if verdict.passed else verdict.status.upper())
    if verdict.mismatch:
        sections = [verdict.mismatch]
    elif verdict.has_baseline:
        rows = [("metric", "value", "baseline", "delta", "allowed", "result")]
        for r in verdict.results:
            rows.append((f"{r.metric} ({r.direction})", _cell(r.value), _cell(r.baseline),
                         "-" if r.delta is None else f"{r.delta:+.4f}", _cell(r.allowed),
                         "PASS" if r.passed else f"FAIL: {r.reason}"))  # fmt: skip
        sections = [_table(rows, markdown)]
    else:
        sections = ["no baseline yet: nothing to compare against (promote one with `make promote`)"]
    if verdict.gates:
        rows = [("export gate", "value", "limit", "params.yaml", "result")]
        for g in verdict.gates:
            rows.append((g.name, f"{g.value:.4f}", f"{g.op} {g.limit:g}", f"export.{g.param}",
                         "PASS" if g.passed else "FAIL"))  # fmt: skip
        sections.append(_table(rows, markdown))
    if markdown:
        return "\n\n".join([*sections, f"**{outcome}**"])
    return "\n\n".join(sections) + "\n" + outcome


def _table(rows: list[tuple[str, ...]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(row) + " |" for row in rows]
        lines.insert(1, "|" + "---|" * len(rows[0]))
        return "\n".join(lines)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
