"""Temperature scaling (Guo et al. 2017): the kept model's validation logits -> one scalar T minimising their NLL,
kept only when it lowers it; model.pt records it, and export divides the ONNX graph's logits by it (tempered.py),
so the served probabilities, the review threshold and the drift watch's confidence are calibrated.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from scipy.optimize import minimize_scalar

from tasks.core.calibration_error import expected_calibration_error, nll
from tasks.images.imaging import PreprocessSpec
from tasks.images.shards import ShardSplit
from tasks.training.models import predict_logits, split_logits

log = logging.getLogger(__name__)

LOG_T_RANGE = (math.log(0.05), math.log(20.0))  # T outside it says the logits carry no usable scale
DECIMALS = 4  # T as recorded: stable bytes across runs whose logits differ in the last float bits


@dataclass(frozen=True)
class TemperatureFit:
    """What model.pt and train_run.json record: T (1.0 when not applied), why, and the validation figures."""

    temperature: float
    applied: bool
    reason: str
    val_images: int
    val_nll_before: float | None
    val_nll_after: float | None
    val_ece_before: float | None
    val_ece_after: float | None

    def to_json(self) -> dict[str, Any]:
        return {"method": "temperature scaling on the validation split (NLL)", **asdict(self)}


def fit_temperature(logits: np.ndarray, labels: np.ndarray) -> TemperatureFit:
    """T = argmin over log T of the validation NLL of softmax(logits / T) (bounded Brent: deterministic).
    Kept when it lowers that NLL; else T = 1, with the reason."""
    count = len(labels)
    if count == 0:
        return TemperatureFit(1.0, False, "no validation images to fit it on", 0, None, None, None, None)
    logits = np.asarray(logits, dtype=np.float64)
    if (logits.argmax(axis=1) == labels).all():  # the NLL then falls for ever as T -> 0: nothing to fit
        return TemperatureFit(1.0, False, f"no errors among the {count} validation images to fit it on", count,
                              None, None, None, None)  # fmt: skip
    before = nll(logits, labels)
    ece_before = expected_calibration_error(logits, labels)
    found = minimize_scalar(lambda log_t: nll(logits, labels, math.exp(log_t)), bounds=LOG_T_RANGE,
                            method="bounded", options={"xatol": 1e-6})  # fmt: skip
    temperature = round(math.exp(float(found.x)), DECIMALS)
    after = nll(logits, labels, temperature)

    def fit(t: float, applied: bool, reason: str) -> TemperatureFit:
        ece_after = expected_calibration_error(logits, labels, t)
        return TemperatureFit(t, applied, reason, count, round(before, 6), round(nll(logits, labels, t), 6),
                              round(ece_before, 6), round(ece_after, 6))  # fmt: skip

    if temperature == 1.0 or not after < before:
        return fit(1.0, False, f"T = {temperature:g} would not lower the validation NLL ({before:.4f})")
    low, high = (math.exp(edge) for edge in LOG_T_RANGE)
    if not low * 1.001 < temperature < high / 1.001:  # the NLL has no minimum inside the range
        why = ("too few validation errors: sharper is always better on them" if temperature < 1
               else "the logits rank the validation labels no better than chance")  # fmt: skip
        return fit(1.0, False, f"the validation NLL keeps falling towards T = {temperature:g} (searched {low:g} to "
                               f"{high:g}): {why}")  # fmt: skip
    return fit(temperature, True, "it lowers the validation NLL")


def calibrate(
    model: torch.nn.Module, images: ShardSplit | np.ndarray, labels: np.ndarray, spec: PreprocessSpec, *,
    enabled: bool,
) -> TemperatureFit:  # fmt: skip
    """The kept model's temperature from the whole validation split (train.calibrate; a ShardSplit is read a block
    at a time), logged."""
    if not enabled:
        fit = TemperatureFit(1.0, False, "train.calibrate is false", len(labels), None, None, None, None)
    else:
        streamed = isinstance(images, ShardSplit)
        logits = split_logits(model, images, spec) if streamed else predict_logits(model, images, spec)
        fit = fit_temperature(logits, labels)
    if fit.applied:
        log.info("calibration: temperature %g fitted on %d validation images: NLL %.4f -> %.4f, ECE %.4f -> %.4f; "
                 "export divides the logits by it", fit.temperature, fit.val_images, fit.val_nll_before,
                 fit.val_nll_after, fit.val_ece_before, fit.val_ece_after)  # fmt: skip
    else:
        log.info("calibration: temperature 1 (not scaled): %s", fit.reason)
    return fit
