"""The regression comparator on its own: directions, tolerances, missing metrics, no baseline."""

from __future__ import annotations

import pytest

from tasks.core.params import Rule
from tasks.release.verdict import compare, format_table, lookup

pytestmark = pytest.mark.fast  # unit-level: make test-fast

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


PER_CLASS = {"accuracy": 0.9, "per_class": {"cat": {"recall": 0.9}, "dog": {"recall": 0.8}}}


def test_wildcard_expands_over_every_class_of_the_baseline() -> None:
    rule = Rule(metric="per_class.*.recall", abs_tol=0.05)
    worse_dog = {"accuracy": 0.9, "per_class": {"cat": {"recall": 0.95}, "dog": {"recall": 0.7}}}
    verdict = compare(worse_dog, PER_CLASS, [rule])
    assert [(r.metric, r.passed) for r in verdict.results] == [
        ("per_class.cat.recall", True),
        ("per_class.dog.recall", False),
    ]
    assert all(r.rule == "per_class.*.recall" for r in verdict.results)
    assert verdict.failures[0].delta == pytest.approx(-0.1)


def test_wildcard_class_missing_from_the_run_fails() -> None:
    run = {"accuracy": 0.9, "per_class": {"cat": {"recall": 0.9}}}
    verdict = compare(run, PER_CLASS, [Rule(metric="per_class.*.recall", abs_tol=0.5)])
    assert not verdict.passed
    assert verdict.failures[0].metric == "per_class.dog.recall"
    assert verdict.failures[0].reason == "missing from this run's metrics"


def test_wildcard_matching_nothing_in_the_baseline_fails() -> None:
    verdict = compare(PER_CLASS, {"accuracy": 0.9}, [Rule(metric="per_class.*.recall")])
    assert not verdict.passed and verdict.results[0].reason == "matches nothing in the baseline"


def test_equal_direction_compares_hashes() -> None:
    # (test_set_sha256 itself is checked before any rule: see the different-test-set test below)
    rule = Rule(metric="labels_sha256", direction="equal")
    same = compare({"labels_sha256": "ab" * 32}, {"labels_sha256": "ab" * 32}, [rule])
    other = compare({"labels_sha256": "cd" * 32}, {"labels_sha256": "ab" * 32}, [rule])
    assert same.passed and not other.passed
    assert other.results[0].reason == "differs from the baseline"
    assert "labels_sha256" in format_table(other) and "abababababab..." in format_table(other)


def test_equal_direction_on_numbers_uses_the_tolerance_both_ways() -> None:
    rule = Rule(metric="accuracy", direction="equal", abs_tol=0.01)
    assert compare({"accuracy": 0.955}, BASE, [rule]).passed
    assert compare({"accuracy": 0.945}, BASE, [rule]).passed
    assert not compare({"accuracy": 0.97}, BASE, [rule]).passed


def test_text_value_under_a_numeric_rule_fails() -> None:
    verdict = compare({"accuracy": "high"}, BASE, [Rule(metric="accuracy")])
    assert not verdict.passed and "not a number" in verdict.results[0].reason


def test_nan_fails_even_with_a_huge_tolerance() -> None:
    verdict = compare({"accuracy": float("nan")}, BASE, [Rule(metric="accuracy", abs_tol=10.0)])
    assert not verdict.passed and verdict.results[0].reason == "not a finite number"


def test_describe_names_metric_value_baseline_and_delta() -> None:
    verdict = compare({**BASE, "accuracy": 0.80}, BASE, [Rule(metric="accuracy", abs_tol=0.02)])
    line = verdict.failures[0].describe()
    assert line.startswith("accuracy: 0.8000 vs baseline 0.9500 (delta -0.1500")
    assert "allowed 0.0200" in line


def test_markdown_table_has_a_row_per_checked_key() -> None:
    verdict = compare(PER_CLASS, PER_CLASS, [Rule(metric="accuracy"), Rule(metric="per_class.*.recall")])
    table = format_table(verdict, markdown=True)
    assert table.count("| PASS |") == 3 and table.endswith("**verdict: PASS**")


def test_verdict_json_round_trips() -> None:
    from tasks.release.verdict import RuleResult, Verdict

    verdict = compare({**BASE, "accuracy": 0.5}, BASE, [Rule(metric="accuracy")])
    data = verdict.to_json()
    again = Verdict(data["passed"], data["has_baseline"], tuple(RuleResult(**r) for r in data["rules"]))
    assert again == verdict


SCORED = {**PER_CLASS, "num_samples": 963, "test_set_sha256": "a" * 64}


def test_a_baseline_of_another_test_set_is_one_line_naming_both() -> None:
    classes = {name: {"recall": 1.0} for name in ("circle", "square", "triangle")}
    other = {"accuracy": 1.0, "num_samples": 36, "test_set_sha256": "b" * 64, "per_class": classes}
    rules = [
        Rule(metric="accuracy"),
        Rule(metric="per_class.*.recall"),
        Rule(metric="test_set_sha256", direction="equal"),
    ]
    verdict = compare(other, SCORED, rules)
    assert not verdict.passed and verdict.status == "different test set" and verdict.results == ()
    line = verdict.summary()
    assert "\n" not in line
    assert "the baseline was scored on 963 images, 2 classes (cat, dog), test set sha256 aaaaaaaaaaaa" in line
    assert "this run on 36 images, 3 classes (circle, square, triangle), test set sha256 bbbbbbbbbbbb" in line
    assert "`make promote`" in line
    assert format_table(verdict).splitlines() == [line, "verdict: DIFFERENT TEST SET"]
    # Same images, other class names (a renamed class folder): not comparable either.
    renamed = {**SCORED, "per_class": {"cat": {"recall": 0.9}, "hound": {"recall": 0.8}}}
    assert compare(renamed, SCORED, rules).status == "different test set"
    # The same test set is compared rule by rule.
    same = compare({**SCORED, "accuracy": 0.5}, SCORED, rules)
    assert same.status == "regression" and [r.metric for r in same.failures] == ["accuracy"]
    assert compare(SCORED, SCORED, rules).status == "pass"
    assert compare(SCORED, None, rules).status == "no baseline"
