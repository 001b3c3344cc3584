"""Temperature scaling (tasks/training/temperature.py): fitted where it helps, T = 1 where it cannot, folded into
the model export traces."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks.core.calibration_error import expected_calibration_error, nll
from tasks.training.models import normalize
from tasks.training.temperature import calibrate, fit_temperature
from tasks.training.tempered import Tempered, temperature_of, tempered
from tests.helpers.training import SPEC, Net

pytestmark = pytest.mark.fast


def drawn(n: int = 2000, classes: int = 10, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Logits and labels drawn from softmax(logits): calibrated by construction."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 1.5, (n, classes))
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    labels = (rng.random((n, 1)) > probs.cumsum(axis=1)).sum(axis=1)
    return logits, labels


def test_overconfident_logits_get_their_temperature_back() -> None:
    logits, labels = drawn()
    fit = fit_temperature(3.0 * logits, labels)  # three times too sharp
    print(fit)
    assert fit.applied and fit.temperature == pytest.approx(3.0, rel=0.1)
    assert fit.val_nll_after < fit.val_nll_before - 0.5
    assert fit.val_nll_after == pytest.approx(nll(3.0 * logits, labels, fit.temperature), abs=1e-6)
    assert fit.val_ece_after < 0.05 < fit.val_ece_before
    assert fit.val_ece_before == pytest.approx(expected_calibration_error(3.0 * logits, labels), abs=1e-6)
    assert fit_temperature(3.0 * logits, labels) == fit  # deterministic
    underconfident = fit_temperature(0.5 * logits, labels)
    assert underconfident.applied and underconfident.temperature == pytest.approx(0.5, rel=0.1)


@pytest.mark.parametrize(
    ("logits", "labels", "reason"),
    [
        (np.zeros((60, 3)), np.arange(60) % 3, "would not lower the validation NLL"),  # no scale can help
        (5 * np.eye(3)[np.arange(30) % 3], np.arange(30) % 3, "no errors among the 30 validation images"),
        (-5 * np.eye(3)[np.arange(30) % 3], np.arange(30) % 3, "no better than chance"),
        (np.zeros((0, 3)), np.zeros(0, np.int64), "no validation images"),
    ],
)
def test_temperature_stays_1_when_it_would_not_lower_the_nll(
    logits: np.ndarray, labels: np.ndarray, reason: str
) -> None:
    fit = fit_temperature(logits, labels)
    assert fit.temperature == 1.0 and not fit.applied
    assert reason in fit.reason
    if fit.val_nll_before is not None:
        assert fit.val_nll_after == fit.val_nll_before


def test_calibrate_scores_the_model_and_honours_train_calibrate() -> None:
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.fc.weight.mul_(40)  # a random net made far too sure of itself
    images = torch.randint(0, 256, (64, 3, 8, 8), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    predicted = model(normalize(images, SPEC)).argmax(1).numpy()
    labels = np.where(np.arange(64) % 3 == 0, (predicted + 1) % 3, predicted)  # two thirds right, all sure
    fit = calibrate(model, images.numpy(), labels, SPEC, enabled=True)
    assert fit.applied and fit.temperature > 2 and fit.val_images == 64
    off = calibrate(model, images.numpy(), labels, SPEC, enabled=False)
    assert off.temperature == 1.0 and not off.applied and off.reason == "train.calibrate is false"
    assert temperature_of({"calibration": fit.to_json()}) == fit.temperature
    assert temperature_of({}) == 1.0  # a model.pt from before calibration


def test_tempered_divides_the_logits() -> None:
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(4, 3, 8, 8)
    assert tempered(model, 1.0) is model
    wrapped = tempered(model, 2.5)
    assert isinstance(wrapped, Tempered)
    torch.testing.assert_close(wrapped(x), model(x) / 2.5)
