"""The drift reference, thresholds and window (tasks/release/drift*.py), without a server: verdicts,
statistics, warnings."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from tasks.core.params import DriftParams
from tasks.release.calibration import Psi
from tasks.release.drift import DRIFT, NO_REFERENCE, NOT_ENOUGH, OK, DriftWindow, psi_terms
from tasks.release.drift_reference import (
    REFERENCE_KEY,
    DriftReferenceError,
    Reference,
    build_reference,
    reference_json,
)
from tasks.release.drift_thresholds import DriftThresholds, Threshold
from tests.helpers.drift import CLASSES, confident, feed, reference_of

THRESHOLDS = DriftThresholds.fixed(window=400, min_predictions=200, value=0.25)


@pytest.fixture
def test_split() -> np.ndarray:
    rng = np.random.default_rng(0)
    return confident(rng, 1000, list(rng.integers(0, 4, 1000)))


def test_the_reference_holds_the_test_splits_class_mix_and_equal_mass_bins(test_split: np.ndarray) -> None:
    ref = build_reference(test_split, CLASSES)
    assert ref["num_samples"] == 1000 and sum(ref["class_counts"]) == 1000
    assert ref["class_counts"] == np.bincount(test_split.argmax(1), minlength=4).tolist()
    for part in ("top1", "margin"):
        counts = ref[part]["counts"]
        assert len(counts) == len(ref[part]["edges"]) + 1 == 10
        assert all(80 <= c <= 120 for c in counts[1:]), counts  # deciles: about 100 each


def test_new_traffic_like_the_test_split_is_ok_and_one_class_is_drift_naming_it(test_split: np.ndarray) -> None:
    rng = np.random.default_rng(1)
    window = DriftWindow(CLASSES, reference_of(test_split), THRESHOLDS)
    feed(window, confident(rng, 150, list(rng.integers(0, 4, 150))))
    report = window.report()
    assert report["verdict"] == NOT_ENOUGH and report["window"]["filled"] == 150
    assert not any(s["exceeded"] for s in report["statistics"].values())
    feed(window, confident(rng, 350, list(rng.integers(0, 4, 350))))
    report = window.report()
    assert report["verdict"] == OK, report["statistics"]
    assert report["window"]["filled"] == 400  # the oldest 100 left the window
    assert sum(report["predictions_total"].values()) == 500
    feed(window, confident(rng, 300, [2] * 300))  # 300 foxes
    report = window.report()
    assert report["verdict"] == DRIFT
    assert report["statistics"]["class_mix_psi"]["exceeded"]
    assert report["moved_most"][0]["class"] == "fox" and report["moved_most"][0]["change"] > 0.5
    fox = next(row for row in report["classes"] if row["class"] == "fox")
    assert fox["observed"] > 0.75 and 0.15 < fox["expected"] < 0.35 and fox["contribution"] > 0.3


def test_unsure_traffic_of_the_same_class_mix_is_a_confidence_drift(test_split: np.ndarray) -> None:
    rng = np.random.default_rng(2)
    window = DriftWindow(CLASSES, reference_of(test_split), THRESHOLDS)
    feed(window, confident(rng, 400, list(rng.integers(0, 4, 400)), sharpness=0.8))  # blurred: same mix, unsure
    report = window.report()
    assert report["verdict"] == DRIFT
    assert report["statistics"]["top1_psi"]["exceeded"] and report["statistics"]["margin_psi"]["exceeded"]
    assert not report["statistics"]["class_mix_psi"]["exceeded"]


def test_a_warning_once_on_crossing_and_once_on_coming_back(test_split: np.ndarray) -> None:
    rng = np.random.default_rng(3)
    calls: list[tuple[str, dict[str, Any]]] = []
    window = DriftWindow(CLASSES, reference_of(test_split), THRESHOLDS, lambda v, r: calls.append((v, r)))
    feed(window, confident(rng, 400, list(rng.integers(0, 4, 400))))
    assert calls == []  # not enough data -> ok says nothing
    feed(window, confident(rng, 400, [0] * 400))
    assert [v for v, _ in calls] == [DRIFT]
    assert calls[0][1]["moved_most"][0]["class"] == "cat"
    feed(window, confident(rng, 400, list(rng.integers(0, 4, 400))))
    assert [v for v, _ in calls] == [DRIFT, OK]


def test_without_a_reference_predictions_are_counted_and_the_verdict_says_so() -> None:
    window = DriftWindow(CLASSES, None, THRESHOLDS)
    probs = confident(np.random.default_rng(4), 300, [1] * 300)
    feed(window, probs)
    report = window.report()
    assert report["verdict"] == NO_REFERENCE and "re-export" in report["detail"]
    assert list(report["predictions_total"].values()) == np.bincount(probs.argmax(1), minlength=4).tolist()
    assert window.values() is None


def test_a_reference_naming_a_class_the_model_lacks_is_refused_in_one_line(test_split: np.ndarray) -> None:
    meta = {REFERENCE_KEY: reference_json(build_reference(test_split, ("cat", "dog", "fox", "wolf")))}
    with pytest.raises(DriftReferenceError) as err:
        Reference.from_metadata(meta, CLASSES, "models/model.onnx")
    assert "\n" not in str(err.value)
    assert "models/model.onnx" in str(err.value) and "wolf" in str(err.value)
    broken = json.loads(meta[REFERENCE_KEY])
    del broken["top1"]
    with pytest.raises(DriftReferenceError, match="malformed"):
        Reference.from_metadata({REFERENCE_KEY: json.dumps(broken)}, CLASSES, "m.onnx")
    assert Reference.from_metadata({}, CLASSES, "m.onnx") is None


def test_the_window_keeps_each_psi_exactly_as_a_full_recompute_gives_it() -> None:
    """The O(1) bookkeeping (_Psi) against psi_terms over the same counts, along a long stream with empty bins,
    full bins and the floor, through the periodic refresh."""
    rng = np.random.default_rng(6)
    expected = [0, 1, 5, 50, 400, 44, 0, 500]  # bins the test split left empty, and a rare one
    psi = Psi(expected)
    window: list[int] = []
    for step in range(5000):
        i = int(rng.choice(8, p=[0.05, 0.1, 0.05, 0.1, 0.3, 0.1, 0.1, 0.2]))
        psi.change(i, 1)
        window.append(i)
        if len(window) > 300:
            psi.change(window.pop(0), -1)
        if step % 700 == 0:
            psi.refresh()
        if step % 97 == 0:
            exact = sum(psi_terms(psi.counts, expected))
            assert psi.value(len(window)) == pytest.approx(exact, rel=1e-9, abs=1e-12), step


class FiftyClasses:
    """A 50-class model's (class, top-1, margin) on data like its test split: class shares of a Dirichlet(5)."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.k, self.prior, self.names = 50, rng.dirichlet(np.full(50, 5.0)), tuple(f"c{i:02d}" for i in range(50))

    def probs(self, rng: np.random.Generator, n: int, prior: np.ndarray | None = None) -> np.ndarray:
        classes = rng.choice(self.k, size=n, p=self.prior if prior is None else prior)
        logits = rng.normal(size=(n, self.k))
        logits[np.arange(n), classes] += 6.0 + rng.normal(size=n)
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)


# The calibration test's power. Its windows are independent, so a threshold whose true false-alarm rate is r
# alarms X ~ Binomial(WINDOWS, r) times, and the test passes when X <= MOST_ALARMS (scipy.stats.binom):
#   P(pass | r = 0.01) = P(X <= 20 | 1200, 0.01) = 0.989   (a right calibration passes)
#   P(fail | r = 0.05) = P(X >= 21 | 1200, 0.05) = 1 - 1e-9 (five times the asked rate fails)
# The old test, at most 2 alarms in 30 windows, passed a true 5% with probability 0.81. Measured on these seeded
# windows: thresholds calibrated for 0.01 alarm 4 times; calibrated for 0.05 and served where 0.01 is asked,
# 21 times, so the test catches them (the calibration is conservative: asked 0.05, about 0.0225 comes true, which
# this test still fails with probability P(X >= 21 | 1200, 0.0225) = 0.90).
WINDOWS, MOST_ALARMS = 1200, 20


def calibrated(model: FiftyClasses, test_images: np.ndarray, rate: float) -> tuple[Reference, DriftThresholds]:
    built = build_reference(test_images, model.names, sizes=(200, 500), false_alarm_rate=rate)
    assert set(built["calibration"]["thresholds"]["class_mix_psi"]) == {"200", "500"}
    ref = Reference.from_metadata({REFERENCE_KEY: reference_json(built)}, model.names, "model.onnx")
    assert ref is not None and ref.calibration is not None
    thresholds, warnings = DriftThresholds.resolve(DriftParams(false_alarm_rate=rate), ref)
    assert warnings == []
    return ref, thresholds


@pytest.mark.slow  # the default suite's budget (issue 59 item 4): make test-slow runs it
def test_calibrated_thresholds_keep_test_like_traffic_ok_at_fifty_classes_and_catch_one_class() -> None:
    """Fixed PSI thresholds of 0.25 read every window of 500 test-like predictions of a 50-class model with 500
    test images as drift (issue 38: 100% at window 200, 20% at 500); calibrated ones stay under their rate, and
    thresholds calibrated for five times the rate are caught (WINDOWS, MOST_ALARMS above)."""
    model = FiftyClasses(7)
    rng = np.random.default_rng(8)
    test_images = model.probs(rng, 500)
    ref, thresholds = calibrated(model, test_images, 0.01)
    loose_ref, loose = calibrated(model, test_images, 0.05)  # a threshold set for 5% where 1% is asked
    fixed = DriftThresholds.fixed(500, 200, 0.25)
    alarms = {"calibrated": 0, "loose": 0, "fixed": 0}
    for i in range(WINDOWS):
        traffic = model.probs(rng, 500)
        checks = [("calibrated", ref, thresholds), ("loose", loose_ref, loose)]
        for name, reference, th in checks + ([("fixed", ref, fixed)] if i < 30 else []):
            window = DriftWindow(model.names, reference, th)
            feed(window, traffic)
            alarms[name] += window.verdict == DRIFT
    assert alarms["calibrated"] <= MOST_ALARMS, alarms
    assert alarms["loose"] > MOST_ALARMS, alarms  # the test has the power to see a miscalibration
    assert alarms["fixed"] >= 3, alarms  # what the fixed thresholds did, in 30 windows
    window = DriftWindow(model.names, ref, thresholds)
    feed(window, model.probs(rng, 200))
    one = np.zeros(50)
    one[13] = 1.0
    feed(window, model.probs(rng, 300, one))  # 300 images of one class
    report = window.report()
    assert report["verdict"] == DRIFT and report["statistics"]["class_mix_psi"]["exceeded"]
    assert report["moved_most"][0]["class"] == "c13"
    assert report["statistics"]["class_mix_psi"]["source"].startswith("calibrated at export: false-alarm rate 0.01")


def test_the_verdict_stays_drift_until_every_statistic_is_back_under_its_recover_level() -> None:
    """Hysteresis in the verdict, not only in the warning: a window between the recover level and the threshold
    reads as it read before, so a nightly run does not flap between Drift and Completed."""
    th = DriftThresholds(20, 10, {s: Threshold(1.0, 0.0, "test", (0.5, 0.0)) for s in ("class_mix_psi",
                                  "top1_psi", "margin_psi")})  # fmt: skip
    ref = Reference(100, CLASSES, (25, 25, 25, 25), (0.5,), (50, 50), (0.5,), (50, 50), "test")
    window = DriftWindow(CLASSES, ref, th)

    def fill(classes: list[int]) -> None:
        for c in classes:
            window.add(c, 0.4 if c % 2 else 0.6, 0.4 if c % 2 else 0.6)

    fill([0, 1, 2, 3] * 5)
    assert window.verdict == OK
    fill([0] * 20)  # class mix PSI over 1
    assert window.verdict == DRIFT
    fill([0, 1, 2, 3, 0, 0, 0, 0, 0, 1] * 2)  # between recover (0.5) and threshold (1.0)
    values = window.values()
    assert values is not None and 0.5 < values["class_mix_psi"] <= 1.0, values
    assert window.verdict == DRIFT and window.report()["verdict"] == DRIFT
    fill([0, 1, 2, 3] * 5)
    assert window.verdict == OK


def test_thresholds_say_where_they_came_from(test_split: np.ndarray) -> None:
    """A number in serve.drift is used as it is; a reference without calibration (an older export) is served
    with the fixed 0.25 and says so; a fixed threshold under the calibrated one is warned of."""
    legacy = reference_of(test_split)
    th, warnings = DriftThresholds.resolve(DriftParams(), legacy)
    assert th.of("class_mix_psi", 300) == 0.25 and "re-export" in th.limits["class_mix_psi"].source
    assert len(warnings) == 1 and "no calibrated thresholds" in warnings[0]
    built = build_reference(test_split, CLASSES, sizes=(200, 500))
    calibrated = Reference.from_metadata({REFERENCE_KEY: reference_json(built)}, CLASSES, "m.onnx")
    th, warnings = DriftThresholds.resolve(DriftParams(class_mix_psi=0.001), calibrated)
    assert th.of("class_mix_psi", 500) == 0.001 and th.limits["class_mix_psi"].source.startswith("fixed: params")
    assert th.limits["top1_psi"].source.startswith("calibrated")
    assert th.of("top1_psi", 200) == pytest.approx(built["calibration"]["thresholds"]["top1_psi"]["200"])
    assert th.of("top1_psi", 500) == pytest.approx(built["calibration"]["thresholds"]["top1_psi"]["500"])
    assert len(warnings) == 1 and "serve.drift.class_mix_psi 0.001 is under" in warnings[0]
    _, warnings = DriftThresholds.resolve(DriftParams(window=1000, false_alarm_rate=0.05), calibrated)
    assert len(warnings) == 1 and "re-export after changing serve.drift" in warnings[0]
