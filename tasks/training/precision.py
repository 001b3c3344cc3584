"""Precision as a value: (train.precision, device) -> autocast context + GradScaler (fp16 only) or None.

auto means bf16 wherever it is native (CPUs with AVX-512 bf16 or AMX, Ampere+ GPUs), fp16 + GradScaler
on older GPUs, and fp32 on CPUs without native bf16: there bf16 is emulated, and a resnet18 step at
64 px ran 2.3x slower than fp32 (61 vs 140 img/s at batch 64, 2 cores). fp16 also runs on CPU
(slowly); the tests use it there to exercise the scaler's skip path.

IMAGEPIPE_NATIVE_BF16=1 (or 0) overrides the CPU detection: a test forces another environment with it,
and a fleet of mixed CPUs can pin one. What auto resolved to is the train stage's environment record
(reports/environment/train.json), so the override is part of DVC's key like the CPU itself.
"""

from __future__ import annotations

import contextlib
import os
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


NATIVE_BF16_ENV = "IMAGEPIPE_NATIVE_BF16"


def cpu_has_native_bf16() -> bool:
    forced = os.environ.get(NATIVE_BF16_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolve_precision(requested: str, device: torch.device) -> Precision:
    if requested == "auto":
        if device.type == "cuda":
            requested = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        else:
            requested = "bf16" if cpu_has_native_bf16() else "fp32"
    return Precision(requested, device.type)
