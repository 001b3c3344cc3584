"""Precision as a value: (train.precision, train.memory_format, device) -> autocast context + GradScaler
(fp16 only) or None, and the memory format that the model and its input batches take.

auto means bf16 wherever it is native (CPUs with AVX-512 bf16 or AMX, Ampere+ GPUs), fp16 + GradScaler
on older GPUs, and fp32 on CPUs without native bf16: there bf16 is emulated, and a resnet18 step at
64 px ran 2.3x slower than fp32 (61 vs 140 img/s at batch 64, 2 cores). fp16 also runs on CPU
(slowly); the tests use it there to exercise the scaler's skip path.

IMAGEPIPE_NATIVE_BF16=1 (or 0) overrides the CPU detection: a test forces another environment with it,
and a fleet of mixed CPUs can pin one. What auto resolved to is the train stage's environment record
(reports/environment/train.json), so the override is part of DVC's key like the CPU itself.

Memory format auto is what measured faster for the device and precision (`resolve_memory_format`,
figures in docs/benchmarks.md), except for a model with a layer torch's CPU kernels break under channels_last
(`Precision.for_model`). The weights saved and exported are contiguous either way, and a checkpoint of either
format loads under the other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from tasks.core.environment import NATIVE_BF16_ENV, cpu_memory_format, cpu_precision
from tasks.core.errors import StageError
from tasks.core.private_api import cpu_native_bf16

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Precision:
    name: str  # resolved: fp32 | bf16 | fp16
    device_type: str  # cpu | cuda
    memory_format: str = "contiguous"  # resolved: contiguous | channels_last

    @property
    def dtype(self) -> torch.dtype | None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.name)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    @property
    def channels_last(self) -> bool:
        return self.memory_format == "channels_last"

    def place(self, tensor_or_module: Any) -> Any:
        """A model or an (N, C, H, W) batch in this run's memory format (no copy when contiguous)."""
        if not self.channels_last:
            return tensor_or_module
        if isinstance(tensor_or_module, torch.nn.Module):
            return tensor_or_module.to(memory_format=torch.channels_last)
        return tensor_or_module.contiguous(memory_format=torch.channels_last)

    def for_model(self, model: torch.nn.Module, requested: str) -> Precision:
        """This precision for `model`: contiguous instead of channels_last on a CPU when the model has a layer whose
        channels_last backward corrupts memory there (`cpu_channels_last_breaks`), with a warning under
        train.memory_format auto and a one-line refusal when channels_last was asked for."""
        layer = cpu_channels_last_breaks(model) if self.channels_last and self.device_type == "cpu" else None
        if layer is None:
            return self
        why = (f"{layer}: torch {torch.__version__}'s CPU backward of a strided 1x1 convolution over fewer than 8 "
               "channels in channels_last crashes the process (a segfault or a hang)")  # fmt: skip
        if requested == "channels_last":
            raise StageError(f"train.memory_format channels_last: {why}; use auto or contiguous")
        log.warning("memory format contiguous, not channels_last: %s", why)
        return dataclasses.replace(self, memory_format="contiguous")

    def make_scaler(self) -> torch.amp.GradScaler | None:
        """fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none."""
        return torch.amp.GradScaler(self.device_type) if self.name == "fp16" else None


__all__ = [
    "NATIVE_BF16_ENV",
    "Precision",
    "cpu_channels_last_breaks",
    "cpu_has_native_bf16",
    "resolve_memory_format",
    "resolve_precision",
]


def cpu_channels_last_breaks(model: torch.nn.Module) -> str | None:
    """The first layer (named, with its shape) whose channels_last backward on a CPU corrupts memory: a 1x1 Conv2d
    with a stride over fewer than 8 input channels, as MobileOne's and FastViT's stems have (measured with
    torch 2.14.1: 2-5 input channels at stride 2 segfaulted or hung; 1, 6, 8 and more, and stride 1, ran)."""
    for name, module in model.named_modules():
        if (isinstance(module, torch.nn.Conv2d) and module.kernel_size == (1, 1) and module.stride != (1, 1)
                and module.in_channels < 8):  # fmt: skip
            return f"layer {name} (Conv2d {module.in_channels} -> {module.out_channels}, 1x1, stride {module.stride})"
    return None


def cpu_has_native_bf16() -> bool:
    forced = os.environ.get(NATIVE_BF16_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    return cpu_native_bf16()


def resolve_precision(requested: str, device: torch.device, memory_format: str = "contiguous",
                      model: torch.nn.Module | None = None) -> Precision:  # fmt: skip
    """The CPU's rules are tasks/core/environment.py's (the environment stage applies them torch-free), fed
    here with torch's own answers; with the `model` that will train, `Precision.for_model` too."""
    if requested == "auto" and device.type == "cuda":
        requested = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    elif device.type != "cuda":
        requested = cpu_precision(requested, cpu_has_native_bf16())
    precision = Precision(requested, device.type, resolve_memory_format(memory_format, requested, device))
    return precision if model is None else precision.for_model(model, memory_format)


def resolve_memory_format(requested: str, precision: str, device: torch.device) -> str:
    """auto: the format that measured faster for this device and precision (bench/bench_train.py, bare step):
    channels_last for native reduced precision (bf16 on a CPU that has it: 1.21x; fp16/bf16 on a GPU) and for
    fp32 on an AVX2 CPU (1.11x and 1.12x in two runs); contiguous elsewhere (fp32 on the earlier CPU without
    native bf16 measured 0.90x and 1.03x; fp32 on a GPU was not measured)."""
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "channels_last" if precision in ("bf16", "fp16") else "contiguous"
    return cpu_memory_format(requested, precision, cpu_has_native_bf16(), torch.backends.cpu.get_cpu_capability())
