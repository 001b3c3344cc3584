"""The regression comparator on its own: directions, tolerances, missing metrics, no baseline."""

from __future__ import annotations

import pytest

from tasks.params import Rule
from tasks.regression import compare, format_table, lookup

BASE = {"accuracy": 0.95, "loss": 0.20, "per_class": {"cat": {"recall": 0.90}}}


def test_lookup_dotted_keys() -> None:
    assert lookup(BASE, "per_class.cat.recall") == 0.90
    assert lookup(BASE, "per_class.dog.recall") is None
    assert lookup({"flag": True}, "flag") is None


@pytest.mark.parametrize(
    ("value", "rule", "passed"),
    [
        (0.94, Rule(metric="accuracy", abs_tol=0.02), True),
        (0.92, Rule(metric="accuracy", abs_tol=0.02), False),
        (0.99, Rule(metric="accuracy"), True),
        (0.95, Rule(metric="accuracy"), True),
        (0.9499, Rule(metric="accuracy"), False),
        (0.9, Rule(metric="accuracy", rel_tol=0.06), True),  # 6% of 0.95 = 0.057
        (0.89, Rule(metric="accuracy", rel_tol=0.06), False),
    ],
)
def test_higher_is_better(value: float, rule: Rule, passed: bool) -> None:
    verdict = compare({**BASE, "accuracy": value}, BASE, [rule])
    assert verdict.passed is passed
    assert verdict.results[0].delta == pytest.approx(value - 0.95)


def test_lower_is_better() -> None:
    rule = Rule(metric="loss", direction="lower", abs_tol=0.05)
    assert compare({"loss": 0.10}, BASE, [rule]).passed
    assert compare({"loss": 0.24}, BASE, [rule]).passed
    failed = compare({"loss": 0.30}, BASE, [rule])
    assert not failed.passed and "worse by 0.1" in failed.results[0].reason


def test_per_class_recall_rule_names_the_class() -> None:
    verdict = compare({**BASE, "per_class": {"cat": {"recall": 0.5}}}, BASE, [Rule(metric="per_class.cat.recall")])
    assert not verdict.passed
    assert "per_class.cat.recall" in format_table(verdict) and "FAIL" in format_table(verdict)


def test_missing_metric_fails_loudly() -> None:
    verdict = compare({"accuracy": 0.99}, BASE, [Rule(metric="macro_f1")])
    assert not verdict.passed and verdict.results[0].reason == "missing from this run's metrics"


def test_no_baseline_passes_and_says_so() -> None:
    verdict = compare(BASE, None, [Rule(metric="accuracy")])
    assert verdict.passed and not verdict.has_baseline
    assert "no baseline" in format_table(verdict)


def test_one_failure_fails_the_verdict() -> None:
    rules = [Rule(metric="accuracy", abs_tol=0.5), Rule(metric="loss", direction="lower")]
    verdict = compare({"accuracy": 0.5, "loss": 0.3}, BASE, rules)
    assert [r.passed for r in verdict.results] == [True, False]
    assert not verdict.passed and format_table(verdict).endswith("verdict: REGRESSION")
