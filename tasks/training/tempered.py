"""A model's temperature as the exported and evaluated model uses it: read from model.pt, and folded into the
graph export traces (logits / T). The fit itself is tasks/training/temperature.py (train's: it needs scipy)."""

from __future__ import annotations

from typing import Any

import torch


def temperature_of(payload: dict[str, Any]) -> float:
    """model.pt's temperature: 1.0 for a model saved before calibration existed or with none applied."""
    return float((payload.get("calibration") or {}).get("temperature", 1.0))


class Tempered(torch.nn.Module):
    """`model`'s logits divided by T: what export traces, so every exported format outputs calibrated logits."""

    def __init__(self, model: torch.nn.Module, temperature: float) -> None:
        super().__init__()
        self.model, self.temperature = model, float(temperature)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x) / self.temperature


def tempered(model: torch.nn.Module, temperature: float) -> torch.nn.Module:
    """`model` itself when T is 1 (the exported graph stays as it was), else `Tempered`."""
    return model if temperature == 1.0 else Tempered(model, temperature).eval()
