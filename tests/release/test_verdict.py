"""The regression comparator on its own: directions, tolerances, missing metrics, no baseline, and the paired tests
(McNemar, the sign-flip test, Holm's correction, rules not judged) on per-image predictions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tasks.core.mcnemar import discordant, mcnemar_p
from tasks.core.params import Rule
from tasks.release.paired import Paired, judgeable, smallest_failing_loss
from tasks.release.verdict import RuleResult, Verdict, compare, lookup
from tasks.release.verdict_table import format_table
from tests.helpers.gate import RULES, by_metric, paired_verdict, scored

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
    assert '`make promote ACCEPT="<why>"`' in line
    assert format_table(verdict).splitlines() == [line, "verdict: DIFFERENT TEST SET"]
    # Same images, other class names (a renamed class folder): not comparable either.
    renamed = {**SCORED, "per_class": {"cat": {"recall": 0.9}, "hound": {"recall": 0.8}}}
    assert compare(renamed, SCORED, rules).status == "different test set"
    # The same test set is compared rule by rule.
    same = compare({**SCORED, "accuracy": 0.5}, SCORED, rules)
    assert same.status == "regression" and [r.metric for r in same.failures] == ["accuracy"]
    assert compare(SCORED, SCORED, rules).status == "pass"
    assert compare(SCORED, None, rules).status == "no baseline"


# -- the paired test: both models' predictions on the same images (check_regression re-scores the baseline) --------


def two_classes(c_base_right: int, c_cand_right: int, c_total: int, c_discordant_gains: int = 0,
                other: int = 300) -> tuple[list[int], list[int], list[int]]:  # fmt: skip
    """Class `c` (index 0) of `c_total` images, the baseline right on the first `c_base_right`; the candidate
    right on `c_discordant_gains` images the baseline got wrong and on the first c_cand_right - gains of the
    baseline's right ones (so its losses are all discordant). Class `d` (`other` images): both always right."""
    labels = [0] * c_total + [1] * other
    baseline = [0] * c_base_right + [1] * (c_total - c_base_right) + [1] * other
    kept = c_cand_right - c_discordant_gains
    candidate = [0] * kept + [1] * (c_base_right - kept) + [0] * c_discordant_gains
    candidate += [1] * (c_total - c_base_right - c_discordant_gains) + [1] * other
    return labels, candidate, baseline


def test_mcnemar_exact_p_and_what_a_rule_can_judge() -> None:
    reference, candidate = np.array([1, 1, 1, 0, 0, 0], bool), np.array([1, 0, 0, 1, 0, 0], bool)
    assert discordant(reference, candidate) == (2, 1)  # right by the reference only, by the candidate only
    assert mcnemar_p(0, 0) == 1.0 and mcnemar_p(5, 0) == pytest.approx(1 / 32) and mcnemar_p(0, 5) == 1.0
    assert mcnemar_p(9, 3) == pytest.approx(sum(math.comb(12, k) for k in range(9, 13)) / 4096)
    assert mcnemar_p(5, 0, two_sided=True) == pytest.approx(2 / 32)
    # The smallest loss beyond 0.05 on 20 images is 2 images (1 image = 0.05 is allowed): 0.5^2 >= 0.05.
    assert smallest_failing_loss(0.05, 20) == 2 and not judgeable(0.05, 20, 0.05)
    # 5 discordant losses reach p < 0.05: a 0.05 tolerance needs 80 images, 0.02 needs 200; none at 0 images.
    assert [judgeable(0.05, n, 0.05) for n in (79, 80)] == [False, True]
    assert [judgeable(0.02, n, 0.05) for n in (199, 200)] == [False, True]
    assert not judgeable(0.05, 0, 0.05) and judgeable(0.05, 20, 0.3)


def test_a_real_five_point_loss_on_200_images_of_a_class_fails() -> None:
    """Baseline 180/200 of class c right, candidate 165/200, every loss on an image the baseline got right."""
    labels, candidate, baseline = two_classes(180, 165, 200)
    verdict = paired_verdict(labels, candidate, baseline, ("c", "d"))
    c = by_metric(verdict)["per_class.c.recall"]
    assert (c.value, c.baseline, c.n, c.test, c.judged) == (0.825, 0.9, 200, "McNemar", True)
    assert c.p_value == pytest.approx(0.5**15, rel=1e-3) and not c.passed
    assert "worse by 0.075, more than the 0.05 allowed (p 3.1e-05, weighted-Holm-adjusted over 3 rules 0.00025 < " \
           "alpha 0.05)" in c.reason  # fmt: skip
    assert not verdict.passed and verdict.status == "regression" and "per_class.c.recall" in verdict.summary()


def test_a_loss_beyond_the_tolerance_that_chance_explains_passes_and_says_so() -> None:
    """200 images of c: the candidate loses 20 the baseline had and wins 9 it missed: -0.055, p 0.031 alone, but
    weighted-Holm adjusted over the 3 rules that can fail (class d's images are the same in both models: it cannot)
    it is 0.061."""
    labels, candidate, baseline = two_classes(180, 169, 200, c_discordant_gains=9)
    c = by_metric(paired_verdict(labels, candidate, baseline, ("c", "d")))["per_class.c.recall"]
    assert c.delta == pytest.approx(-0.055) and c.passed and c.judged
    assert c.p_value == pytest.approx(mcnemar_p(20, 9), abs=1e-4) and c.p_adjusted == pytest.approx(0.0614, abs=1e-3)
    assert "within chance (p 0.031, weighted-Holm-adjusted over 3 rules 0.061 >= alpha 0.05)" in c.reason
    # The same counts with a looser alpha: significant after the correction too, so it fails.
    strict = by_metric(paired_verdict(labels, candidate, baseline, ("c", "d"), alpha=0.2))["per_class.c.recall"]
    assert not strict.passed


def test_equal_models_that_differ_on_a_few_images_of_a_small_class_do_not_fail() -> None:
    """Two equally good models on a 20-image class: 3 images one way, 1 the other. Tolerance alone (delta -0.1
    against 0.05) would fail it; the class is too small to tell a 0.05 loss from chance, and says so."""
    labels, candidate, baseline = two_classes(17, 15, 20, c_discordant_gains=1)
    verdict = paired_verdict(labels, candidate, baseline, ("c", "d"))
    c = by_metric(verdict)["per_class.c.recall"]
    assert (
        c.delta == pytest.approx(-0.1)
        and not compare(scored(labels, candidate, ("c", "d")), scored(labels, baseline, ("c", "d")), RULES).passed
    )
    assert c.passed and not c.judged and c.n == 20 and c.needs == 120
    assert c.reason == "too few images to judge: 20, needs 120 (for p < alpha x 0.2 = 0.01)"
    assert verdict.passed and verdict.status == "pass" and verdict.too_few == (c,)
    assert verdict.summary() == ("PASS: 3 rule(s) and 0 export gate(s) hold against the baseline; 1 of 4 rules not "
                                 "judged, too few test images at family-wise alpha 0.05 (regression.unjudged: warn): "
                                 "per_class.c.recall: 20 test images, needs 120")  # fmt: skip
    assert verdict.headline == "pass, 1 of 4 rules not judged"
    # No difference at all on a small class: nothing can have been lost (no image differs), a certain pass.
    same = by_metric(paired_verdict(labels, baseline, baseline, ("c", "d")))["per_class.c.recall"]
    assert same.passed and same.judged and same.p_value == 1.0 and same.reason == "ok"


def test_a_small_class_that_loses_significantly_fails_anyway() -> None:
    """Too few images to detect a 0.05 loss, but 8 of 20 lost, all discordant, is no chance (p 0.004)."""
    labels, candidate, baseline = two_classes(20, 12, 20)
    c = by_metric(paired_verdict(labels, candidate, baseline, ("c", "d")))["per_class.c.recall"]
    assert not c.passed and c.judged and c.p_value == pytest.approx(0.5**8, rel=1e-3)


def test_the_sign_flip_test_judges_macro_f1_deterministically() -> None:
    labels, candidate, baseline = two_classes(180, 165, 200)
    f1 = by_metric(paired_verdict(labels, candidate, baseline, ("c", "d")))["macro_f1"]
    # 15 images differ: 2^15 swaps, more than 10,000, so drawn; none as bad as the observed one: p = 1 / 10,000
    assert f1.test == "sign-flip" and f1.n == 500 and not f1.passed and f1.p_value == pytest.approx(1 / 10_000)
    again = by_metric(paired_verdict(labels, candidate, baseline, ("c", "d")))["macro_f1"]
    assert again == f1  # a fixed seed: the same verdict every run
    same = by_metric(paired_verdict(labels, baseline, baseline, ("c", "d")))["macro_f1"]
    assert same.passed and same.p_value == 1.0 and same.delta == 0.0
    # A small macro-F1 difference on few images: beyond the tolerance, but within chance.
    labels, candidate, baseline = two_classes(17, 15, 20, c_discordant_gains=1, other=20)
    small = by_metric(paired_verdict(labels, candidate, baseline, ("c", "d")))["macro_f1"]
    assert small.delta < -0.02 and small.passed and small.p_value > 0.05 and "within chance" in small.reason


def test_metrics_the_predictions_do_not_give_are_judged_on_the_tolerance_alone() -> None:
    """loss (from logits) and an old params.yaml's test_set_sha256 rule (equal by construction once re-scored)."""
    labels, candidate, baseline = two_classes(90, 90, 100)
    rules = [Rule(metric="test_set_sha256", direction="equal"), Rule(metric="loss", direction="lower", abs_tol=9)]
    verdict = paired_verdict(labels, candidate, baseline, ("c", "d"), rules=rules)
    assert verdict.passed and [(r.test, r.n, r.p_value) for r in verdict.results] == [
        ("tolerance only", None, None), ("tolerance only", None, None),
    ]  # fmt: skip


def test_the_paired_table_and_json_show_n_p_and_the_baseline_note() -> None:
    labels, candidate, baseline = two_classes(17, 15, 20, c_discordant_gains=1)
    note = "baseline re-scored on today's test set: 320 images, 20 new"
    verdict = compare(scored(labels, candidate, ("c", "d")), scored(labels, baseline, ("c", "d")), RULES,
                      paired=Paired(labels, candidate, baseline, ("c", "d")), baseline_note=note)  # fmt: skip
    markdown = format_table(verdict, markdown=True)
    header = "| metric | value | baseline | delta | allowed | n | p | test | result |"
    assert markdown.startswith(note + "\n\n" + header)
    assert "| per_class.c.recall (higher) | 0.7500 | 0.8500 | -0.1000 | 0.0500 | 20 | 0.3125 (adjusted 1.0000) | " \
           "McNemar | too few images to judge: 20, needs 120 (for p < alpha x 0.2 = 0.01) |" in markdown  # fmt: skip
    assert "weighted-Holm adjusted over the 0 rules that could fail on these predictions (Tarone), gives p < alpha " \
           "(0.05, family-wise); 1 of 4 rules not judged" in markdown  # fmt: skip
    assert markdown.endswith("**verdict: PASS**")
    text = format_table(verdict)
    assert "too few images to judge: 20, needs 120" in text and text.endswith("verdict: PASS")
    data = verdict.to_json()
    assert (
        data["alpha"] == 0.05 and data["baseline_note"] == note and data["too_few_to_judge"] == ["per_class.c.recall"]
    )
    assert data["headline"] == "pass, 1 of 4 rules not judged" and data["family"] == 0
    assert data["not_judged"] == [{"metric": "per_class.c.recall", "n": 20, "needs": 120}]
    row = next(r for r in data["rules"] if r["metric"] == "per_class.c.recall")
    assert (row["n"], row["p_value"], row["judged"], row["test"]) == (20, 0.3125, False, "McNemar")
    assert verdict.summary().endswith("; " + note)
    again = Verdict(data["passed"], data["has_baseline"], tuple(RuleResult(**r) for r in data["rules"]), (), "",
                    data["alpha"], data["baseline_note"], data["unjudged"], data["family"])  # fmt: skip
    assert again == verdict


def test_paired_predictions_of_unequal_length_are_refused() -> None:
    with pytest.raises(ValueError, match="unequal length: 2 labels, 1 candidate, 2 baseline"):
        Paired([0, 1], [0], [0, 1], ("c", "d"))
