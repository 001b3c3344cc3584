"""The drift reference and window (tasks/release/drift.py), without a server: verdicts, statistics, warnings."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from tasks.release.drift import (
    DRIFT,
    NO_REFERENCE,
    NOT_ENOUGH,
    OK,
    REFERENCE_KEY,
    DriftReferenceError,
    DriftThresholds,
    DriftWindow,
    Reference,
    build_reference,
    reference_json,
    sampling_psi,
    top1_and_margin,
)

CLASSES = ("cat", "dog", "fox", "owl")
THRESHOLDS = DriftThresholds(window=400, min_predictions=200, class_mix_psi=0.25, top1_psi=0.25, margin_psi=0.25)


def confident(rng: np.random.Generator, n: int, classes: list[int], sharpness: float = 4.0) -> np.ndarray:
    """Probabilities (n, 4) of a model that picks classes[i] with some confidence."""
    logits = rng.normal(size=(n, len(CLASSES)))
    logits[np.arange(n), classes] += sharpness + rng.normal(size=n)
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def reference_of(probs: np.ndarray) -> Reference:
    meta = {REFERENCE_KEY: reference_json(build_reference(probs, CLASSES))}
    ref = Reference.from_metadata(meta, CLASSES, "model.onnx")
    assert ref is not None
    return ref


@pytest.fixture
def test_split() -> np.ndarray:
    rng = np.random.default_rng(0)
    return confident(rng, 1000, list(rng.integers(0, 4, 1000)))


def feed(window: DriftWindow, probs: np.ndarray) -> None:
    top1, margin = top1_and_margin(probs)
    for row, t, m in zip(probs, top1, margin, strict=True):
        window.add(int(row.argmax()), float(t), float(m))


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


def test_the_sampling_noise_of_a_small_reference_is_what_a_window_like_the_test_split_shows() -> None:
    """sampling_psi's estimate against the top-1 PSI measured on windows drawn like a 50-image test split."""
    rng = np.random.default_rng(5)
    small = confident(rng, 50, list(rng.integers(0, 4, 50)), sharpness=1.5)
    ref = reference_of(small)
    estimate = sampling_psi(ref, 400)
    assert estimate == pytest.approx(9 / 50 + 9 / 400)
    measured = []
    for _ in range(20):
        window = DriftWindow(CLASSES, ref, THRESHOLDS)
        feed(window, confident(rng, 400, list(rng.integers(0, 4, 400)), sharpness=1.5))
        measured.append(window.report()["statistics"]["top1_psi"]["value"])
    assert 0.5 * estimate < float(np.median(measured)) < 2 * estimate, (estimate, measured)
    assert sampling_psi(reference_of(confident(rng, 1000, list(rng.integers(0, 4, 1000)))), 500) < 0.03
