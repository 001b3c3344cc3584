"""Precision as a value: (train.precision, device) -> autocast context + GradScaler (fp16 only) or None.

auto means bf16 wherever it is native (CPUs with AVX-512 bf16/AMX, Ampere+ GPUs), fp16 + GradScaler on
older GPUs. fp16 also runs on CPU (slowly); the tests use it there to exercise the scaler's skip path.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Precision:
    name: str  # resolved: fp32 | bf16 | fp16
    device_type: str  # cpu | cuda

    @property
    def dtype(self) -> torch.dtype | None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.name)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def make_scaler(self) -> torch.amp.GradScaler | None:
        """fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none."""
        return torch.amp.GradScaler(self.device_type) if self.name == "fp16" else None


def resolve_precision(requested: str, device: torch.device) -> Precision:
    if requested == "auto":
        requested = "fp16" if device.type == "cuda" and not torch.cuda.is_bf16_supported() else "bf16"
    return Precision(requested, device.type)
