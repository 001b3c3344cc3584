"""The regression comparator: metrics vs a baseline under rules with direction and tolerance. Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tasks.params import Rule


@dataclass(frozen=True)
class RuleResult:
    metric: str
    direction: str
    value: float | None
    baseline: float | None
    delta: float | None
    allowed: float | None
    passed: bool
    reason: str


@dataclass(frozen=True)
class Verdict:
    passed: bool
    has_baseline: bool
    results: tuple[RuleResult, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "has_baseline": self.has_baseline,
            "rules": [asdict(r) for r in self.results],
        }


def lookup(metrics: Mapping[str, Any], dotted: str) -> float | None:
    """metrics['per_class']['cat']['recall'] for 'per_class.cat.recall'; None when absent."""
    node: Any = metrics
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return float(node) if isinstance(node, int | float) and not isinstance(node, bool) else None


def check_rule(rule: Rule, metrics: Mapping[str, Any], baseline: Mapping[str, Any]) -> RuleResult:
    value, base = lookup(metrics, rule.metric), lookup(baseline, rule.metric)
    if value is None or base is None:
        where = "this run's metrics" if value is None else "the baseline"
        return RuleResult(rule.metric, rule.direction, value, base, None, None, False, f"missing from {where}")
    allowed = max(rule.abs_tol, rule.rel_tol * abs(base))
    delta = value - base
    worsening = -delta if rule.direction == "higher" else delta
    passed = worsening <= allowed + 1e-12
    reason = "ok" if passed else f"worse by {worsening:.6g}, more than the {allowed:.6g} allowed"
    return RuleResult(rule.metric, rule.direction, value, base, round(delta, 6), allowed, passed, reason)


def compare(metrics: Mapping[str, Any], baseline: Mapping[str, Any] | None, rules: Sequence[Rule]) -> Verdict:
    """Every rule checked; with no baseline at all the verdict passes and says so."""
    if baseline is None:
        return Verdict(passed=True, has_baseline=False, results=())
    results = tuple(check_rule(rule, metrics, baseline) for rule in rules)
    return Verdict(passed=all(r.passed for r in results), has_baseline=True, results=results)


def format_table(verdict: Verdict) -> str:
    if not verdict.has_baseline:
        return "no baseline yet: nothing to compare against (promote one with `make promote`); passing"
    fmt = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
    rows = [("rule", "value", "baseline", "delta", "allowed", "result")]
    for r in verdict.results:
        rows.append((f"{r.metric} ({r.direction} is better)", fmt(r.value), fmt(r.baseline), fmt(r.delta),
                     fmt(r.allowed), "PASS" if r.passed else f"FAIL: {r.reason}"))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("verdict: " + ("PASS" if verdict.passed else "REGRESSION"))
    return "\n".join(lines)
