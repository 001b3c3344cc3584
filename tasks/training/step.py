"""One optimizer step: a global batch -> micro-batches -> forward/backward -> checked, clipped update.

The batch is split into `accumulation` micro-batches whose gradients sum to the global batch's mean.
The unscaled gradients are checked for NaN/Inf (train.nonfinite) and clipped once; the schedule
advances only when the optimizer really stepped. Out of memory halves the micro-batch when
train.auto_batch allows it. What the steps have counted (`StepStats`) belongs to the runner.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tasks.core.cli import StageError
from tasks.core.params import TrainParams
from tasks.images.imaging import PreprocessSpec
from tasks.training.distributed import World, all_true
from tasks.training.hooks import Hooks
from tasks.training.imbalance import LOSS_REMEDIES, ImbalanceLoss
from tasks.training.models import head_name, normalize, unwrap
from tasks.training.optim import Schedule, is_head
from tasks.training.precision import Precision
from tasks.training.telemetry import Telemetry, memory_report

log = logging.getLogger(__name__)


class NonFiniteError(StageError):
    """NaN/Inf in the loss or gradients, beyond what train.nonfinite / max_nonfinite allow."""


@dataclass
class StepStats:
    """What the steps have counted; saved whole in every checkpoint."""

    updates: int = 0  # optimizer steps that really happened
    accumulation: int = 1  # doubles on each auto_batch halving
    scaler_skipped: int = 0
    nonfinite: list[dict[str, Any]] = field(default_factory=list)
    auto_batch: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class StepOutcome:
    loss_sum: float
    correct: int
    count: int
    grad_norm: float
    applied: bool
    logits: torch.Tensor  # (B, C) of this rank's part of the batch, detached: the training dynamics


class StepRunner:
    def __init__(
        self,
        *,
        model: torch.nn.Module,
        ddp: torch.nn.parallel.DistributedDataParallel | None,
        optimizer: torch.optim.Optimizer,
        schedule: Schedule,
        precision: Precision,
        params: TrainParams,
        spec: PreprocessSpec,
        device: torch.device,
        world: World,
        telemetry: Telemetry,
        hooks: Hooks | None = None,
        class_counts: Sequence[int] | None = None,
    ) -> None:
        """`class_counts`: images per class in the train split, which train.imbalance's loss remedies weigh by."""
        self.model, self.ddp, self.raw = model, ddp, unwrap(model)
        self.optimizer, self.schedule, self.precision = optimizer, schedule, precision
        self.scaler = precision.make_scaler()
        self.params, self.spec, self.device, self.world = params, spec, device, world
        self.telemetry, self.hooks = telemetry, hooks or Hooks()
        self.criterion: torch.nn.Module = (
            ImbalanceLoss(params.imbalance, class_counts, beta=params.recipe.cb_beta,
                          label_smoothing=params.label_smoothing)
            if params.imbalance in LOSS_REMEDIES
            else torch.nn.CrossEntropyLoss(label_smoothing=params.label_smoothing)
        )  # fmt: skip
        self.trainable = [p for p in self.raw.parameters() if p.requires_grad]
        head = head_name(self.raw)
        self.backbone = [p for name, p in self.raw.named_parameters() if p.requires_grad and not is_head(name, head)]
        self.head_only = False  # the loop sets it for train.freeze_epochs: backbone gradients are dropped
        self.stats = StepStats(accumulation=params.accumulation_steps)
        # train.ema: an exponential moving average of the weights and BatchNorm statistics, updated after each
        # applied step; it is what validation scores and what model.pt holds.
        self.ema = (
            torch.optim.swa_utils.AveragedModel(
                self.raw, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(float(params.ema_decay)),
                use_buffers=True,
            ) if params.ema else None
        )  # fmt: skip

    @property
    def kept(self) -> torch.nn.Module:
        """The weights validation scores and model.pt holds: the average under train.ema, else the model."""
        return self.ema.module if self.ema is not None else self.raw

    def run(self, images: torch.Tensor, labels: torch.Tensor, number: int) -> StepOutcome:
        """Optimizer step `number` (1-based) on one global batch (this rank's part of it)."""
        while True:
            try:
                loss_sum, correct, logits = self._accumulate(images, labels, number)
                break
            except torch.OutOfMemoryError:
                pass  # handled below, once the exception and the activations it references are gone
            self._shrink_micro_batch(images, number)
        if self.head_only:  # no update, momentum or weight decay reaches the frozen backbone (grad None)
            for p in self.backbone:
                p.grad = None
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grads = [p.grad for p in self.trainable if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True) if grads else torch.zeros(())
        grad_norm, loss = float(norm), loss_sum / len(images)
        finite_loss = all_true(math.isfinite(loss))  # every rank must take the same branch
        # With a GradScaler an Inf gradient is an fp16 overflow: the scaler skips that step itself.
        if not finite_loss or (self.scaler is None and not math.isfinite(grad_norm)):
            self._nonfinite(number, loss, finite_loss)
            if self.scaler is not None:
                self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            return StepOutcome(loss_sum, correct, len(images), grad_norm, applied=False, logits=logits)
        if self.params.clip_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(self.trainable, self.params.clip_grad_norm, norm, foreach=True)
        applied = self._update(number)
        return StepOutcome(loss_sum, correct, len(images), grad_norm, applied, logits)

    def _update(self, number: int) -> bool:
        applied = True
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            applied = self.scaler.get_scale() >= scale  # the scale backs off exactly when the step was skipped
            if not applied:
                self.stats.scaler_skipped += 1
                self.telemetry.count("train/scaler_skipped_steps", self.stats.scaler_skipped, number)
        else:
            self.optimizer.step()
        if applied:
            self.stats.updates += 1
            self.schedule.after_update()
            if self.ema is not None:
                self.ema.update_parameters(self.raw)
        return applied

    def _accumulate(self, images: torch.Tensor, labels: torch.Tensor, number: int) -> tuple[float, int, torch.Tensor]:
        """Forward/backward over the micro-batches of one step; gradients sum to the global batch's mean."""
        self.optimizer.zero_grad(set_to_none=True)
        images = images.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)
        micro = -(-len(images) // self.stats.accumulation)
        chunks = list(zip(images.split(micro), labels.split(micro), strict=True))
        loss_sum, correct, outputs = 0.0, 0, []
        for i, (x, y) in enumerate(chunks):
            last = i == len(chunks) - 1
            # DDP all-reduces gradients once per optimizer step, on the last micro-batch.
            sync = self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext()
            with sync:
                with self.precision.autocast():
                    logits = self.model(self.precision.place(normalize(x, self.spec)))
                    loss = self.criterion(logits.float(), y)
                weighted = loss if len(chunks) == 1 else loss * (len(x) / len(images))
                (self.scaler.scale(weighted) if self.scaler is not None else weighted).backward()
            loss_sum += loss.item() * len(x)
            correct += int((logits.argmax(1) == y).sum())
            outputs.append(logits.detach())
        self.hooks.after_backward(number, self.raw, self.scaler.get_scale() if self.scaler is not None else 1.0)
        return loss_sum, correct, torch.cat(outputs)

    def _nonfinite(self, number: int, loss: float, finite_loss: bool) -> None:
        bad = next(
            (n for n, p in self.raw.named_parameters() if p.grad is not None and not bool(p.grad.isfinite().all())),
            None,
        )
        self.stats.nonfinite.append({"step": number, "loss_finite": finite_loss, "first_parameter": bad})
        self.telemetry.count("train/nonfinite_steps", len(self.stats.nonfinite), number)
        what = "gradient" if finite_loss else f"loss ({loss})"
        message = f"step {number}: non-finite {what}; first parameter with a non-finite gradient: {bad}"
        p = self.params
        if p.nonfinite == "abort" or len(self.stats.nonfinite) > p.max_nonfinite:
            rule = "train.nonfinite: abort" if p.nonfinite == "abort" else f"more than max_nonfinite={p.max_nonfinite}"
            raise NonFiniteError(f"{message}. Stopping ({rule}); the last good checkpoint is kept")
        log.warning("%s; step skipped (%d so far)", message, len(self.stats.nonfinite))

    def _shrink_micro_batch(self, images: torch.Tensor, number: int) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        stats = self.stats
        micro = -(-len(images) // stats.accumulation)
        text = (
            f"out of memory at step {number}: micro-batch {micro} per process (global batch {self.params.batch_size}, "
            f"accumulation {stats.accumulation}, {self.world.size} process(es)), images "
            f"{'x'.join(map(str, images.shape[1:]))}, {self.params.arch}, {self.precision.name}; "
            f"{memory_report(self.device)}"
        )
        if not self.params.auto_batch or micro <= 1 or self.world.is_distributed:
            why = " (auto_batch works with one process only)" if self.world.is_distributed else ""
            raise StageError(
                f"{text}. Lower train.batch_size, raise train.accumulation_steps, or set train.auto_batch: true{why}"
            )
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        stats.accumulation *= 2
        micro = -(-len(images) // stats.accumulation)
        stats.auto_batch.append({"step": number, "micro_batch": micro, "accumulation": stats.accumulation})
        log.warning("%s. auto_batch: micro-batch %d, accumulation %d, global batch unchanged", text, micro,
                    stats.accumulation)  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": {k: v.detach().cpu() for k, v in self.raw.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "stats": asdict(self.stats),
            "ema": {k: v.detach().cpu() for k, v in self.ema.state_dict().items()} if self.ema is not None else None,
        }

    def load_state_dict(self, payload: dict[str, Any]) -> None:
        self.raw.load_state_dict(payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        self.schedule.load_state_dict(payload["schedule"])
        if self.scaler is not None and payload["scaler"] is not None:
            self.scaler.load_state_dict(payload["scaler"])
        self.stats = StepStats(**payload["stats"])
        if self.ema is not None:
            self.ema.load_state_dict(payload["ema"])
