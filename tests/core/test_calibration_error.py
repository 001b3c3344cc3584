"""Expected calibration error and NLL on cases worked by hand (tasks/core/calibration_error.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tasks.core.calibration_error import calibration_report, expected_calibration_error, nll, reliability

pytestmark = pytest.mark.fast


def two_class(p: float) -> list[float]:
    """Logits whose softmax gives class 0 the probability p."""
    return [math.log(p / (1 - p)), 0.0]


def test_ece_by_hand() -> None:
    # Top-1 probabilities 0.9, 0.9, 0.9, 0.9 (3 right) and 0.6, 0.6 (1 right), 15 bins:
    # bin (0.8667, 0.9333]: 4 images, confidence 0.9, accuracy 0.75 -> gap 0.15
    # bin (0.5333, 0.6]:    2 images, confidence 0.6, accuracy 0.5  -> gap 0.10
    # ECE = 4/6 x 0.15 + 2/6 x 0.10 = 0.1 + 0.0333 = 0.13333
    logits = np.array([two_class(0.9)] * 4 + [two_class(0.6)] * 2)
    labels = np.array([0, 0, 0, 1, 0, 1])
    assert expected_calibration_error(logits, labels) == pytest.approx(0.4 / 3, abs=1e-9)
    bins = reliability(logits, labels)
    assert bins.bins == 15 and bins.counts.sum() == 6
    assert bins.counts[13] == 4 and bins.counts[8] == 2  # 0.9 * 15 = 13.5 -> bin 13; 0.6 * 15 = 9 -> bin 8
    assert bins.accuracy[13] == pytest.approx(0.75) and bins.confidence[8] == pytest.approx(0.6)


def test_perfect_calibration_and_nll_by_hand() -> None:
    # 10 images at top-1 0.8, 8 of them right: calibrated, ECE 0; NLL = -(8 ln 0.8 + 2 ln 0.2) / 10
    logits = np.array([two_class(0.8)] * 10)
    labels = np.array([0] * 8 + [1] * 2)
    assert expected_calibration_error(logits, labels) == pytest.approx(0.0, abs=1e-12)
    assert nll(logits, labels) == pytest.approx(-(8 * math.log(0.8) + 2 * math.log(0.2)) / 10, abs=1e-12)
    # T = 2 halves the log-odds: p = 2 / (2 + 1) for log-odds ln 4 / 2 = ln 2
    assert nll(logits, labels, 2.0) == pytest.approx(-(8 * math.log(2 / 3) + 2 * math.log(1 / 3)) / 10, abs=1e-12)


def test_report_keys_and_probabilities_in_float64() -> None:
    # Logits of 1e3 apart: float32 softmax would give exactly 0 for the wrong class, an infinite NLL.
    logits = np.array([[1000.0, 0.0], [0.0, 1000.0]], dtype=np.float32)
    report = calibration_report(logits, np.array([0, 0]), temperature=1.0)
    assert set(report) == {"temperature", "bins", "ece", "ece_uncalibrated", "nll", "nll_uncalibrated",
                           "mean_confidence", "share_below_half"}  # fmt: skip
    assert report["nll"] == pytest.approx(500.0) and report["ece"] == pytest.approx(0.5)
    with_t = calibration_report(np.array([two_class(0.8)] * 4), np.array([0, 0, 1, 1]), temperature=4.0)
    # T = 4: log-odds ln 4 / 4 -> p = 4^0.25 / (1 + 4^0.25) = 0.5858 above one half
    assert with_t["mean_confidence"] == pytest.approx(math.sqrt(2) / (1 + math.sqrt(2)), abs=1e-6)
    assert with_t["share_below_half"] == 0.0 and with_t["ece_uncalibrated"] == pytest.approx(0.3)
    assert calibration_report(np.zeros((0, 3)), np.zeros(0, np.int64), 1.0)["ece"] is None
