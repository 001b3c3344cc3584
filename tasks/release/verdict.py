"""The regression comparator: metrics vs a baseline under rules with direction, tolerance and a paired test. Pure.

A rule names a dotted key (`per_class.cat.recall`); `*` stands for every key at its level in the
baseline (`per_class.*.recall`: every class the baseline knows). `higher`/`lower` allow a worsening
of max(abs_tol, rel_tol x |baseline|); `equal` demands the same value (strings such as a hash, or
numbers within the tolerance). Anything missing or not finite fails: a gate never skips a rule.

Given both models' predictions on the same images (`Paired`, tasks/release/paired.py), a worsening beyond the
tolerance fails only when its paired test (McNemar's exact test, or the sign-flip permutation test) says it is not
chance. Every rule with a paired test is one family (accuracy, macro_f1 and each class's recall, by default),
corrected by Holm's step-down at alpha (tasks/release/family.py): the gate is one ship-or-not decision, so its false
alarm is "any rule failed", and equal models fail it in at most alpha of runs at any class count. accuracy and
macro_f1 are in the family, not beside it: beside it, each at alpha, equal models could fail up to 3 x alpha of
runs; inside, their p is multiplied by at most m, which a real loss over the whole test set clears.
A rule whose test cannot reach alpha / m (Holm's strictest level) even at the smallest loss beyond its tolerance
is not judged: it passes and the verdict counts it (`regression.unjudged: warn`), or fails it (`fail`).
Anything else (loss, a hash) is compared on the tolerance alone, and the table (verdict_table.py) says so.
Without per-image predictions (the nightly flow's comparison with baseline/metrics.json) every rule is judged on
its tolerance alone, as before.

The verdict also carries the export's deferred gates (INT8 vs fp32 ONNX): limits from params.yaml,
not a baseline, but a model whose INT8 copy fails them is not releasable either.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from tasks.core.params import RegressionParams, Rule
from tasks.release.family import CLASS, WHOLE, best_weights, tarone_weights, weighted_holm
from tasks.release.paired import MCNEMAR, SIGN_FLIP, Paired, PairedStats
from tasks.release.parity import Check
from tasks.release.rule_check import TOLERANCE, RuleResult, Standing, Value, cell, check_rule, expand, lookup, tolerance
from tasks.release.test_set_match import describe_test_set, mismatch

__all__ = ["MCNEMAR", "SIGN_FLIP", "TOLERANCE", "RuleResult", "Value", "Verdict", "cell", "check_rule", "compare",
           "describe_test_set", "lookup", "mismatch"]  # fmt: skip
_LISTED = 3  # unjudged rules named in the summary line; regression.json lists them all


@dataclass(frozen=True)
class Verdict:
    passed: bool
    has_baseline: bool
    results: tuple[RuleResult, ...]
    gates: tuple[Check, ...] = ()
    mismatch: str = ""  # the baseline could not be compared on this run's test set: why, and what to do
    alpha: float | None = None  # the paired tests' family-wise level; None: no per-image predictions, tolerance only
    baseline_note: str = ""  # how the baseline side was scored ("baseline re-scored on today's test set: ...")
    unjudged: str = "warn"  # regression.unjudged: a rule not judged passes and is counted (warn), or fails (fail)
    family: int = 0  # paired rules that can fail on these predictions (Tarone): the weighted Holm family

    @property
    def status(self) -> str:
        """pass | regression | not judged | different test set | no baseline: one word for tables and dvc exp show."""
        if self.mismatch:
            return "different test set"
        if not self.passed:
            only_unjudged = all(isinstance(r, RuleResult) and not r.judged for r in self.failures)
            return "not judged" if only_unjudged else "regression"
        return "pass" if self.has_baseline else "no baseline"

    @property
    def too_few(self) -> tuple[RuleResult, ...]:
        return tuple(r for r in self.results if not r.judged)

    @property
    def headline(self) -> str:
        """`pass, 11 of 12 rules not judged`: the status, and how many rules were too small to judge (gate.json,
        MLflow's gate.verdict)."""
        few = len(self.too_few)
        return f"{self.status}, {few} of {len(self.results)} rules not judged" if few else self.status

    def _unjudged_text(self) -> str:
        few = self.too_few
        named = ", ".join(r.shortfall() for r in few[:_LISTED])
        more = f", and {len(few) - _LISTED} more (reports/regression.json lists them)" if len(few) > _LISTED else ""
        return (f"{len(few)} of {len(self.results)} rules not judged, too few test images at family-wise alpha "
                f"{self.alpha:g} (regression.unjudged: {self.unjudged}): {named}{more}")  # fmt: skip

    def summary(self) -> str:
        """The verdict in one line a person can act on."""
        if self.mismatch:
            return self.mismatch
        note = f"; {self.baseline_note}" if self.baseline_note else ""
        few = f"; {self._unjudged_text()}" if self.too_few else ""
        if self.status == "not judged":
            return (f"NOT JUDGED: {self._unjudged_text()}; add test images (as many as each needs), or set "
                    f"regression.unjudged: warn to pass them with a warning{note}")  # fmt: skip
        if not self.passed:
            failed = [r for r in self.failures if not isinstance(r, RuleResult) or r.judged]
            names = ", ".join(dict.fromkeys(r.metric if isinstance(r, RuleResult) else r.name for r in failed))
            against = " against the baseline" if self.has_baseline else ""
            return f"REGRESSION: {names} failed{against}{few}{note}"
        if not self.has_baseline:
            return "no baseline yet: nothing to compare against; run `make promote` to make this run the baseline"
        held = len(self.results) - len(self.too_few)
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
            "headline": self.headline,
            "summary": self.summary(),
            "passed": self.passed,
            "has_baseline": self.has_baseline,
            "alpha": self.alpha,
            "family": self.family,
            "unjudged": self.unjudged,
            "baseline_note": self.baseline_note,
            "too_few_to_judge": [r.metric for r in self.too_few],
            "not_judged": [{"metric": r.metric, "n": r.n, "needs": r.needs} for r in self.too_few],
            "rules": [asdict(r) for r in self.results],
            "export_gates": [g.to_json() for g in self.gates],
        }


# -- the verdict -------------------------------------------------------------------------------------------------


def compare(
    metrics: Mapping[str, Any],
    baseline: Mapping[str, Any] | None,
    rules: Sequence[Rule],
    *,
    paired: Paired | None = None,
    alpha: float = 0.05,
    baseline_note: str = "",
    unjudged: str = "warn",
    whole_share: float = RegressionParams.model_fields["whole_share"].default,
) -> Verdict:
    """Every rule checked; with no baseline at all the verdict passes and says so.

    With `paired` (both models' predictions on the same images, `baseline` the baseline's metrics on them), each
    rule also gets its paired test, the paired rules one family at family-wise level `alpha` (Holm); a rule not
    judged passes and is counted (`unjudged` warn) or fails (fail). Without it, a baseline scored on another test
    set (or class set) fails as one `different test set` line instead of rule by rule."""
    if baseline is None:
        return Verdict(passed=True, has_baseline=False, results=())
    stats = PairedStats(paired) if paired is not None else None
    if stats is None:
        different = mismatch(metrics, baseline)
        if different:
            return Verdict(passed=False, has_baseline=True, results=(), mismatch=different,
                           baseline_note=baseline_note)  # fmt: skip
    checks: list[tuple[Rule, str]] = []  # key "": a pattern that matches nothing
    for rule in rules:
        keys = expand(rule.metric, baseline) if "*" in rule.metric else [rule.metric]
        checks += [(rule, key) for key in keys or [""]]
    family, standing = 0, {}
    if stats is not None:  # the paired rules as one family: Tarone's selection, weighted Holm (family.py)
        allowed = [tolerance(rule, metrics, baseline, key) for rule, key in checks]
        inside = [i for i, (_, key) in enumerate(checks) if key and allowed[i] is not None and stats.kind(key)]
        groups = [CLASS if checks[i][1].startswith("per_class.") else WHOLE for i in inside]
        floors = [stats.floor(checks[i][1], checks[i][0].direction, allowed[i]) for i in inside]
        relative = [checks[i][0].weight for i in inside]
        weights = tarone_weights(floors, groups, relative, alpha, whole_share)
        best = best_weights(groups, relative, whole_share)
        p_values = [stats.test_at(checks[i][1], checks[i][0].direction, alpha * (w or b))[1]
                    for i, w, b in zip(inside, weights, best, strict=True)]  # fmt: skip
        family = sum(w > 0 for w in weights)
        weights, adjusted = _step_down(p_values, floors, groups, relative, weights, alpha, whole_share)
        standing = {i: Standing(w, a, family, f, b) for i, w, a, f, b in zip(inside, weights, adjusted, floors, best,
                                                                                 strict=True)}  # fmt: skip
    results = [
        check_rule(rule, metrics, baseline, key, stats=stats, alpha=alpha, standing=standing.get(i)) if key
        else RuleResult(rule.metric, rule.metric, rule.direction, None, None, None, None, False,
                        "matches nothing in the baseline")
        for i, (rule, key) in enumerate(checks)
    ]  # fmt: skip
    if unjudged == "fail":
        results = [replace(r, passed=False) if not r.judged else r for r in results]
    return Verdict(passed=all(r.passed for r in results), has_baseline=True, results=tuple(results),
                   alpha=alpha if stats is not None else None, baseline_note=baseline_note, unjudged=unjudged,
                   family=family)  # fmt: skip


def _step_down(
    p_values: list[float], floors: list[float | None], groups: list[str], relative: list[float], weights: list[float],
    alpha: float, whole_share: float,
) -> tuple[list[float], list[float]]:  # fmt: skip
    """Weighted Holm with Tarone's selection made again after each step (Hommel & Krummenauer 1998): the rules a
    step rejects leave, and the family is chosen anew among the rest, so a rule that could not reach its share
    beside many (a small class whose every image was lost) is judged once the others have failed. Returns each
    rule's weight at its last step and its adjusted p: below alpha for a rejected rule (the largest p / w x the
    weights left up to its step), else weighted Holm's over the first family, at least alpha."""
    first = weighted_holm(p_values, weights)
    rejected: dict[int, float] = {}
    current, running = list(weights), 0.0
    while True:
        left = [i for i in range(len(p_values)) if i not in rejected]
        total = sum(current[i] for i in left)
        step = [i for i in left if current[i] > 0 and p_values[i] <= alpha * current[i] / total]
        if not step:
            break
        for i in step:
            running = max(running, min(1.0, p_values[i] / current[i] * total))
            rejected[i] = running
        remaining = [None if i in rejected else f for i, f in enumerate(floors)]
        again = tarone_weights(remaining, groups, relative, alpha, whole_share)
        current = [current[i] if i in rejected else again[i] for i in range(len(p_values))]
    adjusted = [rejected[i] if i in rejected else max(first[i], alpha) for i in range(len(p_values))]
    return current, adjusted
