"""The optimizer step and the epoch loop: per-rank batches -> updated weights, history rows, checkpoints.

One optimizer step takes one global batch, split into `accumulation` micro-batches; the unscaled
gradients are checked for NaN/Inf and clipped once; the schedule advances only when the optimizer
really stepped. Test faults (tasks/faults.py) are planted only in `Trainer._fault`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from tasks.checkpoint import Checkpointer, capture_rng, restore_rng
from tasks.cli import StageError
from tasks.distributed import (
    World,
    all_gather_objects,
    all_reduce_counts,
    all_reduce_sum,
    all_true,
    barrier,
    broadcast_buffers,
)
from tasks.faults import Faults, FaultSpecError
from tasks.imaging import PreprocessSpec
from tasks.loader import StepSampler
from tasks.metrics import classification_metrics
from tasks.models import normalize, predict_logits, unwrap
from tasks.monitor import Monitor, memory_report
from tasks.optim import Schedule, set_train_mode
from tasks.params import TrainParams
from tasks.precision import Precision
from tasks.runstate import Progress, StepOutcome

log = logging.getLogger(__name__)


class NonFiniteError(StageError):
    """NaN/Inf in the loss or gradients, beyond what train.nonfinite / max_nonfinite allow."""


class Trainer:
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
        monitor: Monitor,
        faults: Faults,
    ) -> None:
        self.model, self.ddp, self.raw = model, ddp, unwrap(model)
        self.optimizer, self.schedule, self.precision = optimizer, schedule, precision
        self.scaler = precision.make_scaler()
        self.params, self.spec, self.device, self.world = params, spec, device, world
        self.monitor, self.faults = monitor, faults
        self.criterion = torch.nn.CrossEntropyLoss(label_smoothing=params.label_smoothing)
        self.trainable = [p for p in self.raw.parameters() if p.requires_grad]
        self.epoch_generator_state: torch.Tensor | None = None

    # -- one optimizer step -------------------------------------------------------------------------

    def step(self, images: torch.Tensor, labels: torch.Tensor, progress: Progress) -> StepOutcome:
        number = progress.step + 1
        while True:
            try:
                loss_sum, correct = self._accumulate(images, labels, progress.accumulation, number)
                break
            except torch.OutOfMemoryError:
                pass  # handled below, once the exception and the activations it references are gone
            self._shrink_micro_batch(images, progress, number)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grads = [p.grad for p in self.trainable if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True) if grads else torch.zeros(())
        grad_norm, loss = float(norm), loss_sum / len(images)
        finite_loss = all_true(math.isfinite(loss))  # every rank must take the same branch
        # With a GradScaler an Inf gradient is an fp16 overflow: the scaler skips that step itself.
        if not finite_loss or (self.scaler is None and not math.isfinite(grad_norm)):
            self._nonfinite(progress, number, loss, finite_loss)
            if self.scaler is not None:
                self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            return StepOutcome(loss_sum, correct, len(images), grad_norm, applied=False)
        if self.params.clip_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(self.trainable, self.params.clip_grad_norm, norm, foreach=True)
        applied = True
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            applied = self.scaler.get_scale() >= scale  # the scale backs off exactly when the step was skipped
            if not applied:
                progress.scaler_skipped += 1
                self.monitor.count("train/scaler_skipped_steps", progress.scaler_skipped, number)
        else:
            self.optimizer.step()
        if applied:
            progress.updates += 1
            self.schedule.after_update()
        return StepOutcome(loss_sum, correct, len(images), grad_norm, applied)

    def _accumulate(
        self, images: torch.Tensor, labels: torch.Tensor, accumulation: int, number: int
    ) -> tuple[float, int]:
        """Forward/backward over the micro-batches of one step; gradients sum to the global batch's mean."""
        self.optimizer.zero_grad(set_to_none=True)
        images = images.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)
        micro = -(-len(images) // accumulation)
        chunks = list(zip(images.split(micro), labels.split(micro), strict=True))
        loss_sum, correct = 0.0, 0
        for i, (x, y) in enumerate(chunks):
            last = i == len(chunks) - 1
            # DDP all-reduces gradients once per optimizer step, on the last micro-batch.
            sync = self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext()
            with sync:
                with self.precision.autocast():
                    self._fault("oom", number, first=i == 0)
                    logits = self.model(normalize(x, self.spec))
                    loss = self.criterion(logits.float(), y)
                loss = self._fault("nan", number, loss=loss)
                weighted = loss if len(chunks) == 1 else loss * (len(x) / len(images))
                (self.scaler.scale(weighted) if self.scaler is not None else weighted).backward()
            loss_sum += loss.item() * len(x)
            correct += int((logits.argmax(1) == y).sum())
        self._fault("grad", number)
        return loss_sum, correct

    def _fault(self, kind: str, number: int, *, first: bool = True, loss: torch.Tensor | None = None) -> Any:
        """THE place where IMAGEPIPE_FAULT plants NaN, Inf and OOM (tests only; a no-op otherwise)."""
        if not self.faults.pending:
            return loss
        if kind == "oom" and first and self.faults.take("oom", "step", number) is not None:
            raise torch.OutOfMemoryError(f"planted out-of-memory at step {number} (IMAGEPIPE_FAULT)")
        if kind == "nan" and self.faults.take("nan", "step", number) is not None:
            return loss * float("nan")
        if kind == "grad":
            for bad, value in (("nan-grad", float("nan")), ("inf-grad", float("inf"))):
                name = self.faults.take(bad, "step", number)
                if name is not None:
                    params = dict(self.raw.named_parameters())
                    if name not in params:
                        raise FaultSpecError(f"{bad}@step:{number}:{name}: no parameter {name!r} in the model")
                    grad = params[name].grad
                    if grad is not None:
                        grad.view(-1)[0] = value * (self.scaler.get_scale() if self.scaler else 1.0)
        return loss

    def _nonfinite(self, progress: Progress, number: int, loss: float, finite_loss: bool) -> None:
        bad = next(
            (n for n, p in self.raw.named_parameters() if p.grad is not None and not bool(p.grad.isfinite().all())),
            None,
        )
        progress.nonfinite.append({"step": number, "loss_finite": finite_loss, "first_parameter": bad})
        self.monitor.count("train/nonfinite_steps", len(progress.nonfinite), number)
        what = "gradient" if finite_loss else f"loss ({loss})"
        message = f"step {number}: non-finite {what}; first parameter with a non-finite gradient: {bad}"
        p = self.params
        if p.nonfinite == "abort" or len(progress.nonfinite) > p.max_nonfinite:
            rule = "train.nonfinite: abort" if p.nonfinite == "abort" else f"more than max_nonfinite={p.max_nonfinite}"
            raise NonFiniteError(f"{message}. Stopping ({rule}); the last good checkpoint is kept")
        log.warning("%s; step skipped (%d so far)", message, len(progress.nonfinite))

    def _shrink_micro_batch(self, images: torch.Tensor, progress: Progress, number: int) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        micro = -(-len(images) // progress.accumulation)
        text = (
            f"out of memory at step {number}: micro-batch {micro} per process (global batch {self.params.batch_size}, "
            f"accumulation {progress.accumulation}, {self.world.size} process(es)), images "
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
        progress.accumulation *= 2
        micro = -(-len(images) // progress.accumulation)
        progress.auto_batch.append({"step": number, "micro_batch": micro, "accumulation": progress.accumulation})
        log.warning("%s. auto_batch: micro-batch %d, accumulation %d, global batch unchanged", text, micro,
                    progress.accumulation)  # fmt: skip

    # -- checkpoints ----------------------------------------------------------------------------

    def save(self, checkpointer: Checkpointer, progress: Progress, *, is_best: bool) -> None:
        """Every rank calls this (the partial sums are reduced); only the main process writes."""
        state = dataclasses.asdict(progress)
        sums = all_reduce_sum([progress.loss_sum, progress.correct, progress.count])
        state["loss_sum"], state["correct"], state["count"] = sums[0], int(sums[1]), int(sums[2])
        state["seen"] = all_reduce_counts(progress.seen) if progress.seen is not None else None
        if self.world.is_main:
            assert self.epoch_generator_state is not None
            checkpointer.save(
                {
                    "model": {k: v.detach().cpu() for k, v in self.raw.state_dict().items()},
                    "optimizer": self.optimizer.state_dict(),
                    "schedule": self.schedule.state_dict(),
                    "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                    "progress": state,
                    "rng": capture_rng(self.epoch_generator_state),
                },
                is_best=is_best,
            )
        # No rank runs past a checkpoint before it is on disk: when any rank dies later, the whole
        # job resumes from this one (torchrun stops the other ranks, possibly mid-write otherwise).
        barrier()

    def restore(self, payload: dict[str, Any], generator: torch.Generator) -> Progress:
        self.raw.load_state_dict(payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        self.schedule.load_state_dict(payload["schedule"])
        if self.scaler is not None and payload["scaler"] is not None:
            self.scaler.load_state_dict(payload["scaler"])
        progress = Progress(**payload["progress"])
        if not self.world.is_main:  # the checkpoint holds all ranks' partial sums: count them once
            progress.loss_sum, progress.correct, progress.count = 0.0, 0, 0
            progress.seen = torch.zeros_like(progress.seen) if progress.seen is not None else None
        self.epoch_generator_state = restore_rng(payload["rng"])
        generator.set_state(self.epoch_generator_state)
        return progress

    # -- the epoch loop ---------------------------------------------------------------------------

    def fit(
        self,
        *,
        loader: torch.utils.data.DataLoader,
        sampler: StepSampler,
        dataset: Any,
        generator: torch.Generator,
        progress: Progress,
        checkpointer: Checkpointer,
        validate: Callable[[torch.nn.Module], dict[str, Any]],
    ) -> Progress:
        p, steps = self.params, sampler.steps_per_epoch
        for epoch in range(progress.epoch, p.epochs):
            if progress.batch_in_epoch == 0:
                self.epoch_generator_state = generator.get_state()
            dataset.set_epoch(epoch)
            sampler.start = progress.batch_in_epoch * loader.batch_size
            if progress.seen is None:
                progress.seen = torch.zeros(sampler.num_samples, dtype=torch.int32)
            set_train_mode(self.raw, frozen_backbone=p.freeze_backbone)
            bar = tqdm(total=steps, initial=progress.batch_in_epoch, desc=f"epoch {epoch + 1}/{p.epochs}", unit="step",
                       mininterval=2.0, disable=not self.world.is_main)  # fmt: skip
            tick = time.perf_counter()
            for images, labels, indices in loader:
                loaded = time.perf_counter()
                self.faults.kill_if_due("step", progress.step + 1)
                out = self.step(images, labels, progress)
                progress.step, progress.batch_in_epoch = progress.step + 1, progress.batch_in_epoch + 1
                progress.loss_sum += out.loss_sum
                progress.correct += out.correct
                progress.count += out.count
                progress.seen[indices] += 1
                done = time.perf_counter()
                self.monitor.step(
                    progress.step, loss=out.loss_sum / out.count, accuracy=out.correct / out.count,
                    grad_norm=out.grad_norm, lrs=self.schedule.lrs(), wait_s=loaded - tick, compute_s=done - loaded,
                    images=out.count * self.world.size,
                )  # fmt: skip
                self.monitor.histograms(progress.step, self.raw)
                bar.update(1)
                bar.set_postfix(loss=f"{progress.loss_sum / progress.count:.3f}",
                                img_s=f"{out.count * self.world.size / (done - tick):.0f}", refresh=False)  # fmt: skip
                every = p.checkpoint_every_steps
                if every and progress.step % every == 0 and progress.batch_in_epoch < steps:
                    self.save(checkpointer, progress, is_best=False)
                tick = time.perf_counter()
            bar.close()
            improved = self._end_epoch(epoch, progress, validate)
            self.epoch_generator_state = generator.get_state()  # = the next epoch's start
            self.save(checkpointer, progress, is_best=improved)
        return progress

    def _end_epoch(self, epoch: int, progress: Progress, validate: Callable[[torch.nn.Module], dict[str, Any]]) -> bool:
        loss_sum, correct, count = all_reduce_sum([progress.loss_sum, progress.correct, progress.count])
        seen = all_reduce_counts(progress.seen)
        broadcast_buffers(self.raw)
        metrics = validate(self.raw)
        row = {
            "epoch": epoch + 1,
            "train_loss": round(loss_sum / count, 6),
            "train_accuracy": round(correct / count, 6),
            "val_loss": metrics["loss"],
            "val_accuracy": metrics["accuracy"],
            "lr": round(self.schedule.lrs()["head"], 8),
        }
        progress.history.append(row)
        progress.coverage.append(
            {
                "epoch": epoch + 1,
                "seen_once": int((seen == 1).sum()),
                "seen_more_than_once": int((seen > 1).sum()),
                "not_seen": int((seen == 0).sum()),
            }
        )
        self.schedule.after_epoch(row)
        value = row[self.params.monitor]
        higher = self.params.monitor == "val_accuracy"
        improved = progress.best is None or (value > progress.best if higher else value < progress.best)
        if improved:
            progress.best, progress.best_epoch = value, epoch + 1
        progress.epoch, progress.batch_in_epoch = epoch + 1, 0
        progress.loss_sum, progress.correct, progress.count, progress.seen = 0.0, 0, 0, None
        self.monitor.epoch(epoch + 1, row)
        log.info("epoch %d: train loss %.4f acc %.4f | val loss %.4f acc %.4f | lr %.5f",
                 epoch + 1, row["train_loss"], row["train_accuracy"], row["val_loss"], row["val_accuracy"],
                 row["lr"])  # fmt: skip
        return improved


def validate(
    model: torch.nn.Module, images: np.ndarray, labels: np.ndarray, spec: PreprocessSpec, world: World
) -> dict[str, Any]:
    """Validation metrics over the whole split; under DDP each rank scores every world-th image."""
    part = np.arange(len(labels))[world.rank :: world.size]
    logits = predict_logits(model, images if world.size == 1 else images[part], spec)
    full = np.zeros((len(labels), len(spec.class_names)), dtype=np.float32)
    for index, block in all_gather_objects((part, logits)):
        full[index] = block
    return classification_metrics(full, labels, spec.class_names)
