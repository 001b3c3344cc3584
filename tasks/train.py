"""Stage train: train shards -> models/model.pt (weights + spec + provenance), per-epoch history and plot.

Seeded end to end with deterministic algorithms: the same params and shards give the same weights.
bf16 autocast on CPU; TensorBoard logs under paths.runs.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from tasks.augment import Augment
from tasks.cli import stage_main
from tasks.imaging import PreprocessSpec
from tasks.io import sha256_file, write_json
from tasks.metrics import classification_metrics
from tasks.models import build_model, normalize, predict_logits, save_model_file
from tasks.params import Params, TrainParams, derive_seed, section_hash
from tasks.plots import plot_history
from tasks.shards import MANIFEST, ShardDataset, ShardSplit, load_manifest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    model_path: Path
    val_accuracy: float
    epochs: int
    images_per_second: float


def seed_everything(seed: int, threads: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads or os.cpu_count() or 1)


def autocast(precision: str) -> contextlib.AbstractContextManager:
    """Precision as a value: bf16 autocast on CPU for 'auto' and 'bf16', nothing for 'fp32'."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=torch.bfloat16)


def warmup_cosine(total_steps: int, warmup_steps: int) -> Any:
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def make_optimizer(model: torch.nn.Module, params: TrainParams) -> torch.optim.Optimizer:
    if params.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=params.lr, weight_decay=params.weight_decay)
    return torch.optim.SGD(
        model.parameters(),
        lr=params.lr,
        momentum=params.momentum,
        nesterov=params.momentum > 0,
        weight_decay=params.weight_decay,
    )


def run(
    params: TrainParams,
    *,
    seed: int,
    shard_dir: Path,
    model_path: Path,
    history_path: Path,
    plot_path: Path,
    runs_dir: Path,
    provenance: dict[str, str],
) -> TrainResult:
    seed = derive_seed(seed, "train")
    seed_everything(seed, params.threads)
    manifest = load_manifest(shard_dir)
    spec = PreprocessSpec.model_validate(manifest["spec"])
    train_set = ShardDataset(shard_dir, "train", augment=Augment(params.augment), seed=seed)
    val = ShardSplit.open(shard_dir, "val")
    val_images = val.all_images()
    loader = torch.utils.data.DataLoader(
        train_set,
        batch_size=params.batch_size,
        shuffle=True,
        drop_last=len(train_set) > params.batch_size,
        num_workers=params.num_workers,
        generator=torch.Generator().manual_seed(derive_seed(seed, "loader")),
    )
    model = build_model(params.arch, len(spec.class_names))
    optimizer = make_optimizer(model, params)
    steps_per_epoch = len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        warmup_cosine(params.epochs * steps_per_epoch, round(params.warmup_epochs * steps_per_epoch)),
    )
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=params.label_smoothing)
    writer = SummaryWriter(str(runs_dir / "train"))
    history: list[dict[str, float]] = []
    step, seen, train_time = 0, 0, 0.0
    for epoch in range(params.epochs):
        train_set.set_epoch(epoch)
        model.train()
        loss_sum, correct, count, wait = 0.0, 0, 0, 0.0
        start = tick = time.perf_counter()
        bar = tqdm(loader, desc=f"epoch {epoch + 1}/{params.epochs}", unit="batch", mininterval=2.0)
        for images, labels in bar:
            wait += time.perf_counter() - tick
            with autocast(params.precision):
                logits = model(normalize(images, spec))
                loss = criterion(logits.float(), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            loss_sum += loss.item() * len(labels)
            correct += int((logits.argmax(1) == labels).sum())
            count += len(labels)
            writer.add_scalar("train/loss", loss.item(), step)
            writer.add_scalar("train/lr", scheduler.get_last_lr()[0], step)
            bar.set_postfix(loss=f"{loss_sum / count:.3f}", acc=f"{correct / count:.3f}", refresh=False)
            tick = time.perf_counter()
        elapsed = time.perf_counter() - start
        train_time, seen = train_time + elapsed, seen + count
        val_metrics = classification_metrics(predict_logits(model, val_images, spec), val.labels, spec.class_names)
        row = {
            "epoch": epoch + 1,
            "train_loss": round(loss_sum / count, 6),
            "train_accuracy": round(correct / count, 6),
            "val_loss": val_metrics["loss"],
            "val_accuracy": val_metrics["accuracy"],
            "lr": round(scheduler.get_last_lr()[0], 8),
        }
        history.append(row)
        for key, value in row.items():
            if key != "epoch":
                writer.add_scalar(f"epoch/{key}", value, epoch + 1)
        writer.add_scalar("perf/images_per_second", count / elapsed, epoch + 1)
        writer.add_scalar("perf/data_wait_fraction", wait / elapsed, epoch + 1)
        log.info(
            "epoch %d: train loss %.4f acc %.4f | val loss %.4f acc %.4f | %.0f img/s, data wait %.1f%%",
            epoch + 1, row["train_loss"], row["train_accuracy"], row["val_loss"], row["val_accuracy"],
            count / elapsed, 100 * wait / elapsed,
        )  # fmt: skip
    writer.close()

    save_model_file(model_path, model, arch=params.arch, spec=spec, provenance=provenance)
    write_json(history_path, history)
    plot_history(history, plot_path)
    return TrainResult(model_path, history[-1]["val_accuracy"], params.epochs, seen / max(train_time, 1e-9))


def _main(p: Params) -> None:
    shard_dir = p.paths.shards
    result = run(
        p.train,
        seed=p.seed,
        shard_dir=shard_dir,
        model_path=p.paths.model,
        history_path=p.paths.reports / "train_history.json",
        plot_path=p.paths.reports / "train_curves.png",
        runs_dir=p.paths.runs,
        provenance={
            "params_sha256": section_hash(p.train),
            "seed": str(p.seed),
            "data_manifest_sha256": sha256_file(shard_dir / MANIFEST),
        },
    )
    log.info("model -> %s (val accuracy %.4f, %.0f img/s)", result.model_path, result.val_accuracy,
             result.images_per_second)  # fmt: skip


def main() -> None:
    stage_main("train", _main)


if __name__ == "__main__":
    main()
