"""Train params + model -> optimizer with backbone/head param groups, frozen backbone, lr schedule.

The schedule advances only after an optimizer step that really happened (not on a step the GradScaler
or the NaN policy dropped): warmup then cosine or step decay per step, or ReduceLROnPlateau per epoch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, LinearLR, LRScheduler, ReduceLROnPlateau

from tasks.core.params import TrainParams
from tasks.training.models import head_name


def is_head(name: str, head: str) -> bool:
    return name == head or name.startswith(head + ".")


def freeze_backbone(model: torch.nn.Module) -> list[str]:
    """Stop gradients everywhere but the head; returns the frozen parameter names."""
    head = head_name(model)
    frozen = [name for name, p in model.named_parameters() if not is_head(name, head)]
    for name, p in model.named_parameters():
        p.requires_grad_(is_head(name, head))
    return frozen


def set_train_mode(model: torch.nn.Module, *, frozen_backbone: bool) -> None:
    """model.train(), except frozen BatchNorm layers, which keep their running statistics (eval mode)."""
    model.train()
    if frozen_backbone:
        head = head_name(model)
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and not is_head(name, head):
                module.eval()


def build_optimizer(model: torch.nn.Module, params: TrainParams) -> torch.optim.Optimizer:
    """Groups named for the logs: backbone at lr x backbone_lr_scale (absent when frozen), head at lr.

    Weight decay reaches only conv and linear weights unless train.decay_norm_and_bias: BatchNorm's scale
    and shift and every bias (any parameter of one dimension, as timm's param_groups_weight_decay decides)
    go into a `<group>_no_decay` group of the same lr. Decaying them shrinks what normalisation undoes."""
    head = head_name(model)
    groups: dict[str, list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            group = "head" if is_head(name, head) else "backbone"
            if not params.decay_norm_and_bias and p.ndim <= 1:
                group += "_no_decay"
            groups.setdefault(group, []).append(p)
    lrs = {"backbone": params.lr * params.backbone_lr_scale, "head": params.lr}
    order = ("backbone", "backbone_no_decay", "head", "head_no_decay")
    param_groups: list[dict[str, Any]] = [
        {"params": groups[name], "lr": lrs[name.removesuffix("_no_decay")], "name": name,
         **({"weight_decay": 0.0} if name.endswith("_no_decay") else {})}
        for name in order if groups.get(name)
    ]  # fmt: skip
    if not any(group["name"].startswith("head") for group in param_groups):
        param_groups.append({"params": [], "lr": params.lr, "name": "head"})
    if params.optimizer == "adamw":
        return torch.optim.AdamW(param_groups, lr=params.lr, weight_decay=params.weight_decay)
    return torch.optim.SGD(
        param_groups, lr=params.lr, momentum=params.momentum, nesterov=params.momentum > 0,
        weight_decay=params.weight_decay,
    )  # fmt: skip


def warmup_cosine(total_steps: int, warmup_steps: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def warmup_step(warmup_steps: int, every: int, gamma: float) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return gamma ** ((step - warmup_steps) // max(1, every))

    return factor


class Schedule:
    """The lr schedule of a run: one per-step scheduler and, for `plateau`, one per-epoch scheduler."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: TrainParams, steps_per_epoch: int) -> None:
        self.optimizer, self.monitor = optimizer, params.monitor
        warmup = round(params.warmup_epochs * steps_per_epoch)
        self.per_step: LRScheduler | None = None
        self.plateau: ReduceLROnPlateau | None = None
        if params.scheduler == "cosine":
            self.per_step = LambdaLR(optimizer, warmup_cosine(params.epochs * steps_per_epoch, warmup))
        elif params.scheduler == "step":
            every = round(params.step_epochs * steps_per_epoch)
            self.per_step = LambdaLR(optimizer, warmup_step(warmup, every, params.gamma))
        else:
            # LinearLR and ReduceLROnPlateau both scale the current lr, so they compose.
            if warmup > 1:
                self.per_step = LinearLR(optimizer, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1)
            mode = "max" if params.monitor == "val_accuracy" else "min"
            patience = params.plateau_patience
            self.plateau = ReduceLROnPlateau(optimizer, mode=mode, factor=params.gamma, patience=patience)

    def after_update(self) -> None:
        if self.per_step is not None:
            self.per_step.step()

    def after_epoch(self, metrics: dict[str, float]) -> None:
        if self.plateau is not None:
            self.plateau.step(metrics[self.monitor])

    def lrs(self) -> dict[str, float]:
        return {group["name"]: group["lr"] for group in self.optimizer.param_groups}

    def state_dict(self) -> dict[str, Any]:
        return {
            "per_step": self.per_step.state_dict() if self.per_step else None,
            "plateau": self.plateau.state_dict() if self.plateau else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.per_step is not None:
            self.per_step.load_state_dict(state["per_step"])
        if self.plateau is not None:
            self.plateau.load_state_dict(state["plateau"])
