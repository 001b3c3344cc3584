"""Faults planted in training through its lifecycle hooks (tasks/training/hooks.py); tests only.

A subprocess gets them with `IMAGEPIPE_TRAIN_HOOKS=<this file>` and `IMAGEPIPE_FAULT=<spec>` (see
`fault_env`); an in-process test passes `FaultHooks.parse(spec)` as the hooks. Production code never
imports this module. Grammar: comma-separated `kind@point:N[:arg]`, each firing once:
    nan@step:N                 the model's output in optimizer step N (1-based) becomes NaN, so its loss does
    nan-grad@step:N:PARAM      the gradient of parameter PARAM becomes NaN at step N
    inf-grad@step:N:PARAM      ... becomes +Inf (with fp16 this is an overflow the GradScaler skips)
    oom@step:N                 the first forward of step N raises torch.OutOfMemoryError
    kill@step:N                SIGKILL just before step N runs (mid-epoch when N is not an epoch end)
    kill@after-ckpt:K          SIGKILL right after the K-th checkpoint of this process is on disk
    kill@ckpt-write:K          SIGKILL half-way through writing the K-th checkpoint (its temporary file is
                               cut to half its bytes, never renamed into place)
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch

from tasks.training.hooks import Hooks

ENV = "IMAGEPIPE_FAULT"
KINDS = {"nan", "nan-grad", "inf-grad", "oom", "kill"}
POINTS = {"step", "after-ckpt", "ckpt-write"}


class FaultSpecError(ValueError):
    pass


def fault_env(spec: str | None) -> dict[str, str]:
    """The environment variables that plant `spec` in a `python -m tasks.train` subprocess."""
    if not spec:
        return {}
    return {"IMAGEPIPE_TRAIN_HOOKS": str(Path(__file__).resolve()), "IMAGEPIPE_ALLOW_TEST_HOOKS": "1", ENV: spec}


def kill_now() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer or `kill -9` does: no cleanup at all


class FaultHooks(Hooks):
    def __init__(self, pending: dict[tuple[str, str, int], str]) -> None:
        self.pending = pending  # (kind, point, n) -> arg
        self.step = 0
        self.forwards_in_step = 0

    @classmethod
    def parse(cls, text: str) -> FaultHooks:
        pending = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            try:
                kind, rest = item.split("@", 1)
                point, number, *arg = rest.split(":", 2)
                n = int(number)
            except ValueError:
                raise FaultSpecError(f"{ENV}: cannot parse {item!r} (expected kind@point:N[:arg])") from None
            if kind not in KINDS or point not in POINTS:
                raise FaultSpecError(f"{ENV}: unknown fault {item!r}; kinds {sorted(KINDS)}, points {sorted(POINTS)}")
            if kind.endswith("-grad") and not arg:
                raise FaultSpecError(f"{ENV}: {item!r} needs a parameter name ({kind}@step:N:PARAM)")
            pending[(kind, point, n)] = arg[0] if arg else ""
        return cls(pending)

    def take(self, kind: str, point: str, n: int) -> str | None:
        """The fault's argument ('' when it has none) if it is due now; it fires only once."""
        return self.pending.pop((kind, point, n), None)

    # -- the hooks ------------------------------------------------------------------------------

    def on_fit_start(self, model: torch.nn.Module) -> None:
        model.register_forward_pre_hook(self._before_forward)
        model.register_forward_hook(self._after_forward)

    def on_step_start(self, step: int) -> None:
        self.step, self.forwards_in_step = step, 0
        if self.take("kill", "step", step) is not None:
            kill_now()

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        self.forwards_in_step += 1
        if self.forwards_in_step == 1 and self.take("oom", "step", self.step) is not None:
            raise torch.OutOfMemoryError(f"planted out-of-memory at step {self.step} ({ENV})")

    def _after_forward(self, module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        if self.take("nan", "step", self.step) is not None:
            return output * float("nan")
        return None

    def after_backward(self, step: int, model: torch.nn.Module, loss_scale: float) -> None:
        for bad, value in (("nan-grad", float("nan")), ("inf-grad", float("inf"))):
            name = self.take(bad, "step", step)
            if name is None:
                continue
            params = dict(model.named_parameters())
            if name not in params:
                raise FaultSpecError(f"{bad}@step:{step}:{name}: no parameter {name!r} in the model")
            grad = params[name].grad
            if grad is not None:
                grad[(0,) * grad.ndim] = value * loss_scale  # in place, whatever the memory format

    def before_checkpoint_commit(self, tmp: Path, number: int) -> None:
        if self.take("kill", "ckpt-write", number) is not None:
            with open(tmp, "r+b") as handle:
                handle.truncate(tmp.stat().st_size // 2)
            kill_now()

    def after_checkpoint(self, path: Path, number: int) -> None:
        if self.take("kill", "after-ckpt", number) is not None:
            kill_now()


def make_hooks() -> FaultHooks:
    """What IMAGEPIPE_TRAIN_HOOKS loads: the faults IMAGEPIPE_FAULT names."""
    return FaultHooks.parse(os.environ.get(ENV, ""))


def plant(monkeypatch: Any, spec: str) -> None:
    """Plant `spec` in every training run of this test, in-process or in a subprocess it starts."""
    for name, value in fault_env(spec).items():
        monkeypatch.setenv(name, value)
