"""The epoch loop: batches -> steps (tasks/training/step.py) -> validation, history rows, checkpoints.

`EpochLoop` owns where the run is (`Progress`), the best metric and the checkpoints; the step runner
owns what the steps counted. A checkpoint holds both, plus the RNG states, so a run killed anywhere
resumes to the same weights. Every rank runs the loop; only the main process writes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from tasks.core.metrics import classification_metrics
from tasks.images.imaging import PreprocessSpec
from tasks.images.shards import ShardSplit
from tasks.training.checkpoint import Checkpointer, capture_rng, restore_rng
from tasks.training.distributed import (
    World,
    all_gather_objects,
    all_reduce_counts,
    all_reduce_sum,
    barrier,
    broadcast_buffers,
)
from tasks.training.dynamics import Dynamics
from tasks.training.epoch_record import epoch_line
from tasks.training.loader import StepSampler
from tasks.training.models import predict_logits, split_logits
from tasks.training.optim import set_train_mode
from tasks.training.step import StepRunner

log = logging.getLogger(__name__)

Validate = Callable[[torch.nn.Module], dict[str, Any]]


@dataclass
class Progress:
    """Where the loop is and what this epoch has counted; saved whole in every checkpoint."""

    step: int = 0  # global batches consumed (optimizer steps attempted), over all epochs
    epoch: int = 0  # epoch in progress, 0-based
    batch_in_epoch: int = 0
    loss_sum: float = 0.0  # this epoch (this rank; all ranks' sums in a checkpoint)
    correct: int = 0
    count: int = 0
    seen: torch.Tensor | None = None  # times each training sample was trained on this epoch
    best: float | None = None
    best_epoch: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    coverage: list[dict[str, Any]] = field(default_factory=list)


class EpochLoop:
    def __init__(
        self, runner: StepRunner, *, checkpointer: Checkpointer, generator: torch.Generator, dynamics_samples: int
    ) -> None:
        self.runner, self.checkpointer, self.generator = runner, checkpointer, generator
        self.params, self.world, self.telemetry = runner.params, runner.world, runner.telemetry
        self.progress = Progress()
        self.dynamics = Dynamics(dynamics_samples)
        self.epoch_generator_state: torch.Tensor | None = None

    # -- checkpoints ----------------------------------------------------------------------------

    def save(self, *, is_best: bool) -> None:
        """Every rank calls this (the partial sums are reduced); only the main process writes."""
        progress = self.progress
        state = dataclasses.asdict(progress)
        sums = all_reduce_sum([progress.loss_sum, progress.correct, progress.count])
        state["loss_sum"], state["correct"], state["count"] = sums[0], int(sums[1]), int(sums[2])
        state["seen"] = all_reduce_counts(progress.seen) if progress.seen is not None else None
        dynamics = self.dynamics.reduced()
        if self.world.is_main:
            assert self.epoch_generator_state is not None
            payload = {**self.runner.state_dict(), "progress": state, "dynamics": dynamics,
                       "rng": capture_rng(self.epoch_generator_state)}  # fmt: skip
            self.checkpointer.save(payload, is_best=is_best)
        # No rank runs past a checkpoint before it is on disk: when any rank dies later, the whole
        # job resumes from this one (torchrun stops the other ranks, possibly mid-write otherwise).
        barrier()

    def restore(self, payload: dict[str, Any]) -> Progress:
        self.runner.load_state_dict(payload)
        progress = Progress(**payload["progress"])
        self.dynamics.load(payload["dynamics"], is_main=self.world.is_main)
        if not self.world.is_main:  # the checkpoint holds all ranks' partial sums: count them once
            progress.loss_sum, progress.correct, progress.count = 0.0, 0, 0
            progress.seen = torch.zeros_like(progress.seen) if progress.seen is not None else None
        self.epoch_generator_state = restore_rng(payload["rng"])
        self.generator.set_state(self.epoch_generator_state)
        self.progress = progress
        return progress

    # -- the loop -------------------------------------------------------------------------------

    def fit(self, *, loader: torch.utils.data.DataLoader, sampler: StepSampler, dataset: Any,
            validate: Validate) -> Progress:  # fmt: skip
        p, progress, steps = self.params, self.progress, sampler.steps_per_epoch
        self.runner.hooks.on_fit_start(self.runner.raw)
        for epoch in range(progress.epoch, p.epochs):
            if progress.batch_in_epoch == 0:
                self.epoch_generator_state = self.generator.get_state()
            dataset.set_epoch(epoch)
            sampler.start = progress.batch_in_epoch * loader.batch_size
            if progress.seen is None:
                progress.seen = torch.zeros(sampler.num_samples, dtype=torch.int32)
            head_only = epoch < int(p.freeze_epochs)  # fine-tuning: the head alone first (tasks/training/recipe.py)
            self.runner.head_only = head_only
            set_train_mode(self.runner.raw, frozen_backbone=p.freeze_backbone or head_only)
            bar = tqdm(total=steps, initial=progress.batch_in_epoch, desc=f"epoch {epoch + 1}/{p.epochs}", unit="step",
                       mininterval=2.0, disable=not self.world.is_main)  # fmt: skip
            tick = time.perf_counter()
            for images, labels, indices in loader:
                loaded = time.perf_counter()
                self._step(images, labels, indices, wait_s=loaded - tick, started=loaded, bar=bar)
                every = p.checkpoint_every_steps
                if every and progress.step % every == 0 and progress.batch_in_epoch < steps:
                    self.save(is_best=False)
                tick = time.perf_counter()
            bar.close()
            improved = self._end_epoch(epoch, validate)
            self.epoch_generator_state = self.generator.get_state()  # = the next epoch's start
            self.save(is_best=improved)
        return progress

    def _step(self, images: torch.Tensor, labels: torch.Tensor, indices: torch.Tensor, *, wait_s: float,
              started: float, bar: tqdm) -> None:  # fmt: skip
        progress, runner = self.progress, self.runner
        runner.hooks.on_step_start(progress.step + 1)
        out = runner.run(images, labels, progress.step + 1)
        progress.step, progress.batch_in_epoch = progress.step + 1, progress.batch_in_epoch + 1
        progress.loss_sum += out.loss_sum
        progress.correct += out.correct
        progress.count += out.count
        progress.seen.index_add_(0, indices, torch.ones_like(indices, dtype=progress.seen.dtype))  # repeats count
        self.dynamics.add(indices, out.logits, labels)
        done = time.perf_counter()
        self.telemetry.step(
            progress.step, loss=out.loss_sum / out.count, accuracy=out.correct / out.count, grad_norm=out.grad_norm,
            lrs=runner.schedule.lrs(), wait_s=wait_s, compute_s=done - started, images=out.count * self.world.size,
        )  # fmt: skip
        self.telemetry.histograms(progress.step, runner.raw)
        bar.update(1)
        rate = out.count * self.world.size / (done - started + wait_s)
        bar.set_postfix(loss=f"{progress.loss_sum / progress.count:.3f}", img_s=f"{rate:.0f}", refresh=False)

    def _end_epoch(self, epoch: int, validate: Validate) -> bool:
        progress = self.progress
        loss_sum, correct, count = all_reduce_sum([progress.loss_sum, progress.correct, progress.count])
        seen = all_reduce_counts(progress.seen)
        broadcast_buffers(self.runner.raw)
        if self.runner.ema is not None:
            broadcast_buffers(self.runner.kept)  # each rank averaged its own BatchNorm statistics
        metrics = validate(self.runner.kept)
        row = {
            "epoch": epoch + 1,
            "train_loss": round(loss_sum / count, 6),
            "train_accuracy": round(correct / count, 6),
            "val_loss": metrics["loss"],
            "val_accuracy": metrics["accuracy"],
            "lr": round(self.runner.schedule.lrs()["head"], 8),
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
        self.runner.schedule.after_epoch(row)
        value = row[self.params.monitor]
        higher = self.params.monitor == "val_accuracy"
        improved = progress.best is None or (value > progress.best if higher else value < progress.best)
        if improved:
            progress.best, progress.best_epoch = value, epoch + 1
        progress.epoch, progress.batch_in_epoch = epoch + 1, 0
        progress.loss_sum, progress.correct, progress.count, progress.seen = 0.0, 0, 0, None
        self.telemetry.epoch(epoch + 1, row)
        log.info("epoch %d: train loss %.4f acc %.4f | val loss %.4f acc %.4f | lr %.5f",
                 epoch + 1, row["train_loss"], row["train_accuracy"], row["val_loss"], row["val_accuracy"],
                 row["lr"])  # fmt: skip
        log.info("%s", epoch_line(row))  # the same row for a watcher of the run (a sweep's pruner)
        return improved


def validate(
    model: torch.nn.Module, images: ShardSplit | np.ndarray, labels: np.ndarray, spec: PreprocessSpec, world: World
) -> dict[str, Any]:
    """Validation metrics over the whole split (a ShardSplit is read a block at a time); under DDP each rank scores
    every world-th image."""
    part = np.arange(len(labels))[world.rank :: world.size]
    mine = None if world.size == 1 else part
    if isinstance(images, ShardSplit):
        logits = split_logits(model, images, spec, indices=mine)
    else:
        logits = predict_logits(model, images if mine is None else images[mine], spec)
    full = np.zeros((len(labels), len(spec.class_names)), dtype=np.float32)
    for index, block in all_gather_objects((part, logits)):
        full[index] = block
    return classification_metrics(full, labels, spec.class_names)
