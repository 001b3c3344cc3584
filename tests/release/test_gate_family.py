"""The gate's rules as one family (Holm), the exact sign-flip test, and rules not judged said, not passed in
silence: in the summary, gate.json and MLflow's gate.verdict, and failing under regression.unjudged: fail."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tasks.check_regression import gate_record
from tasks.core.params import Rule, load_params
from tasks.release.family import weighted_holm
from tasks.release.paired import Paired, PairedStats
from tasks.release.run_record import gather
from tasks.release.verdict import compare
from tests.helpers.gate import RULES, by_metric, classes_with, paired_verdict, scored
from tests.helpers.tracking import finished_project

pytestmark = pytest.mark.fast  # unit-level: make test-fast


def test_holm_adjusted_p_values_step_down() -> None:
    # sorted 0.01, 0.02, 0.04 (m = 3): 3 x 0.01, max(0.03, 2 x 0.02), max(0.04, 1 x 0.04)
    assert weighted_holm([0.04, 0.01, 0.02], [1, 1, 1]) == pytest.approx([0.04, 0.03, 0.04])  # equal weights: Holm
    assert weighted_holm([0.5, 0.9], [1, 1]) == [1.0, 1.0] and weighted_holm([], []) == []


def test_many_equal_classes_no_longer_fail_but_one_clearly_worse_class_does() -> None:
    """100 classes of 300 images, the two models equal overall: 5 classes lose 26 images and win 10 (-0.053, beyond
    the 0.05 tolerance, McNemar p 0.0057 < 0.05 alone), 5 others the reverse. Rule by rule at alpha, 5 classes
    failed; as one family, luck of that size is expected among 100 classes and passes. The family is 12 rules:
    the 90 classes whose 6 differing images cannot lose 16 (the smallest loss beyond 0.05 of 300) cannot fail,
    and leave it (Tarone)."""
    counts = [(26, 10)] * 5 + [(10, 26)] * 5 + [(3, 3)] * 90
    labels, candidate, baseline, names = classes_with(300, counts)
    verdict = paired_verdict(labels, candidate, baseline, names)
    lucky = by_metric(verdict)["per_class.c0.recall"]
    assert lucky.delta == pytest.approx(-16 / 300, abs=1e-6) and lucky.p_value == pytest.approx(0.005665, abs=1e-5)
    assert lucky.passed and lucky.judged and lucky.p_adjusted > 0.05
    assert "weighted-Holm-adjusted over 12 rules" in lucky.reason
    assert verdict.passed and verdict.family == 12 and verdict.too_few == ()
    assert verdict.summary() == "PASS: 102 rule(s) and 0 export gate(s) hold against the baseline"

    worse = [(40, 0)] + counts[1:]  # class c0 loses 40 of its 270 right images (-0.133, p 2^-40)
    labels, candidate, baseline, names = classes_with(300, worse)
    verdict = paired_verdict(labels, candidate, baseline, names)
    assert [r.metric for r in verdict.failures] == ["per_class.c0.recall"]
    assert verdict.status == "regression" and verdict.summary().startswith("REGRESSION: per_class.c0.recall failed")


def test_the_sign_flip_test_is_exact_on_a_hand_computable_case() -> None:
    """Images (true class): 0, 0, 1, 1. The baseline gets all four; the candidate misses image 0 (says 1) and
    image 2 (says 0): macro F1 0.5 against 1.0. Only those two images differ, so there are 4 swaps of who said
    what: none (-0.5), both (+0.5), either one alone (0.7333 - 0.7333 = 0). As bad for the candidate as the
    observed -0.5: 1 of 4, so the exact p is 0.25."""
    labels, candidate, baseline, names = [0, 0, 1, 1], [1, 0, 0, 1], [0, 0, 1, 1], ("a", "b")
    stats = PairedStats(Paired(labels, candidate, baseline, names))
    assert stats.sign_flip_p("macro_f1", "higher") == pytest.approx(0.25)
    assert stats.sign_flip_p("macro_f1", "equal") == pytest.approx(0.5)  # two-sided: twice the smaller tail
    # precision of "a", candidate minus baseline: 1/2 - 1 (none), +1/2 (both), 2/3 - 1 (image 0 alone), 1 - 2/3
    # (image 2 alone): as bad as -1/2, 1 of 4
    assert stats.sign_flip_p("per_class.a.precision", "higher") == pytest.approx(0.25)
    f1 = by_metric(compare(scored(labels, candidate, names), scored(labels, baseline, names),
                           [Rule(metric="macro_f1", abs_tol=0.02)], paired=Paired(labels, candidate, baseline, names),
                           alpha=0.3))["macro_f1"]  # fmt: skip
    assert (f1.test, f1.p_value, f1.passed) == ("sign-flip", 0.25, False)


def test_the_drawn_sign_flips_agree_with_scipys_own_random_test() -> None:
    """Beyond 2^13 differing-image swaps the test draws them (numpy, stopped early when p is clearly large):
    its p is scipy.stats.permutation_test's on the same data, within Monte-Carlo error."""
    from scipy.stats import permutation_test

    rng = np.random.default_rng(3)
    labels = rng.integers(0, 3, 60)
    baseline = np.where(rng.random(60) < 0.85, labels, (labels + 1) % 3)
    candidate = np.where(rng.random(60) < 0.65, labels, (labels + 2) % 3)  # 22 images differ
    names = ("a", "b", "c")
    stats = PairedStats(Paired(labels.tolist(), candidate.tolist(), baseline.tolist(), names))
    ours = stats.sign_flip_p("macro_f1", "higher")
    differ = candidate != baseline
    assert differ.sum() > 13 and ours is not None

    def macro_f1(predicted: np.ndarray) -> float:
        full = candidate.copy()
        full[differ] = predicted
        return scored(labels.tolist(), full.tolist(), names)["macro_f1"]

    def statistic(x: np.ndarray, y: np.ndarray) -> float:
        return macro_f1(x) - macro_f1(y)

    theirs = permutation_test((candidate[differ], baseline[differ]), statistic, permutation_type="samples",
                              vectorized=False, n_resamples=2000, alternative="less", rng=0).pvalue  # fmt: skip
    assert 0.02 < theirs < 0.2  # a p that neither test resolves by its floor or its early stop alone (0.057)
    assert ours == pytest.approx(theirs, rel=0.3)  # (0.063)


# class c0 of 20 images: too few to judge a 0.05 tolerance; c1 the same in both models (judged: nothing can be lost)
SMALL = classes_with(20, [(3, 1), (0, 0)])


def test_a_rule_not_judged_is_said_in_the_summary_gate_json_and_mlflow(tmp_path: Path) -> None:
    verdict = paired_verdict(*SMALL)
    assert verdict.passed and verdict.status == "pass" and verdict.headline == "pass, 2 of 4 rules not judged"
    not_judged = [(r.metric, r.n, r.needs) for r in verdict.too_few]
    assert not_judged == [("accuracy", 40, 250), ("per_class.c0.recall", 20, 120)]
    assert verdict.summary() == (
        "PASS: 2 rule(s) and 0 export gate(s) hold against the baseline; 2 of 4 rules not judged, too few test images "
        "at family-wise alpha 0.05 (regression.unjudged: warn): accuracy: 40 test images, needs 250, "
        "per_class.c0.recall: 20 test images, needs 120"
    )
    gate = gate_record(verdict, enforced=True)
    assert gate["verdict"] == "pass" and gate["headline"] == "pass, 2 of 4 rules not judged"
    assert (gate["not_judged"], gate["rules"]) == (2, 4) and gate["summary"] == verdict.summary()
    root = finished_project(tmp_path / "proj")
    (root / "reports" / "gate.json").write_text(json.dumps(gate))
    record = gather(load_params(root / "params.yaml"), root)
    assert record.tags["gate.verdict"] == "pass, 2 of 4 rules not judged"


def test_regression_unjudged_fail_fails_the_gate_naming_the_rules_and_the_images_they_need() -> None:
    labels, candidate, baseline, names = SMALL
    metrics, base = scored(labels, candidate, names), scored(labels, baseline, names)
    verdict = compare(metrics, base, RULES, paired=Paired(labels, candidate, baseline, names), unjudged="fail")
    assert not verdict.passed and verdict.status == "not judged"
    assert verdict.headline == "not judged, 2 of 4 rules not judged"
    assert verdict.summary() == (
        "NOT JUDGED: 2 of 4 rules not judged, too few test images at family-wise alpha 0.05 (regression.unjudged: "
        "fail): accuracy: 40 test images, needs 250, per_class.c0.recall: 20 test images, needs 120; add test images "
        "(as many as each needs), or set regression.unjudged: warn to pass them with a warning"
    )
    assert [r.metric for r in verdict.failures] == ["accuracy", "per_class.c0.recall"]
    assert gate_record(verdict, enforced=True)["passed"] is False
    # A real regression beside them stays a regression, and still names the rules not judged.
    labels, candidate, baseline, names = classes_with([20, 400], [(3, 1), (60, 0)])
    both = compare(scored(labels, candidate, names), scored(labels, baseline, names), RULES,
                   paired=Paired(labels, candidate, baseline, names), unjudged="fail")  # fmt: skip
    assert both.status == "regression" and both.headline == "regression, 1 of 4 rules not judged"
    assert both.summary().startswith("REGRESSION: accuracy, macro_f1, per_class.c1.recall failed against the "
                                     "baseline; 1 of 4 rules not judged")  # fmt: skip


def test_the_sign_flip_test_takes_a_single_differing_image() -> None:
    """One image differs (the candidate misses the last 1): its two arrangements give macro F1 deltas -d and +d,
    so the observed one is as bad as itself alone: p 0.5 one-sided, 1.0 two-sided, never a crash (scipy's
    permutation_test refuses fewer than two observations, and the gate called it with one)."""
    labels, candidate, baseline, names = [0, 0, 1, 1], [0, 0, 1, 0], [0, 0, 1, 1], ("a", "b")
    stats = PairedStats(Paired(labels, candidate, baseline, names))
    assert stats.sign_flip_p("macro_f1", "higher") == pytest.approx(0.5)
    assert stats.sign_flip_p("macro_f1", "lower") == pytest.approx(1.0)
    assert stats.sign_flip_p("macro_f1", "equal") == pytest.approx(1.0)
    f1 = by_metric(paired_verdict(labels, candidate, baseline, names))["macro_f1"]
    assert f1.test == "sign-flip" and f1.p_value == pytest.approx(0.5)
