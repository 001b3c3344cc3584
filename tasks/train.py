"""Stage train: train shards -> models/model.pt (weights + spec + provenance), per-epoch history + plot,
reports/train_run.json (what the run did); checkpoints and TensorBoard logs under paths.runs.

Seeded end to end with deterministic algorithms: the same params and shards give the same weights,
also when the run was killed and rerun (it resumes from its last checkpoint). The loop is in
tasks/trainer.py; train.nproc_per_node > 1 reruns this module under torchrun.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tasks import distributed
from tasks.augment import Augment
from tasks.checkpoint import Checkpointer, RunIdentity, load_init_weights, prune_runs, run_identity
from tasks.cli import StageError, stage_main
from tasks.dataset import ShardDataset
from tasks.faults import Faults
from tasks.imaging import PreprocessSpec
from tasks.io import sha256_file, write_json
from tasks.loader import StepSampler, make_loader
from tasks.models import build_model, save_model_file
from tasks.monitor import Monitor
from tasks.optim import Schedule, build_optimizer, freeze_backbone
from tasks.params import Params, TrainParams, derive_seed, section_hash
from tasks.plots import plot_history
from tasks.precision import Precision, resolve_precision
from tasks.recipe import Recipe, resolve
from tasks.runstate import Progress, cpu_threads, seed_everything, warn_if_cores_busy
from tasks.shards import MANIFEST, ShardSplit, load_manifest
from tasks.trainer import Trainer, validate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    model_path: Path
    val_accuracy: float
    epochs: int
    images_per_second: float
    resumed_from_step: int  # 0: started fresh
    run_dir: Path  # this run's checkpoints


def state_sha256(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


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
    checkpoint_dir: Path | None = None,
    run_meta_path: Path | None = None,
) -> TrainResult:
    world = distributed.world_from_env()
    if not world.is_main:  # one voice: the other ranks report only warnings and errors
        logging.getLogger().setLevel(logging.WARNING)
    try:
        device = distributed.resolve_device(params.device, world)
    except RuntimeError as exc:
        raise StageError(str(exc)) from None
    distributed.init(world, device)
    try:
        return _train(
            params, seed=seed, shard_dir=shard_dir, model_path=model_path, history_path=history_path,
            plot_path=plot_path, runs_dir=runs_dir, provenance=provenance, world=world, device=device,
            checkpoint_dir=checkpoint_dir or runs_dir / "checkpoints",
            run_meta_path=run_meta_path or history_path.with_name("train_run.json"),
        )  # fmt: skip
    finally:
        distributed.shutdown()


def _train(
    params: TrainParams,
    *,
    seed: int,
    shard_dir: Path,
    model_path: Path,
    history_path: Path,
    plot_path: Path,
    runs_dir: Path,
    provenance: dict[str, str],
    world: distributed.World,
    device: torch.device,
    checkpoint_dir: Path,
    run_meta_path: Path,
) -> TrainResult:
    seed = derive_seed(seed, "train")
    threads = cpu_threads(params.threads, world.local_size)
    if world.is_main and device.type == "cpu":
        warn_if_cores_busy(threads, world.local_size)
    seed_everything(seed, threads, device)
    faults = Faults.from_env()
    spec = PreprocessSpec.model_validate(load_manifest(shard_dir)["spec"])
    train_set = ShardDataset(shard_dir, "train", augment=Augment(params.augment), seed=seed)
    recipe = resolve(params, len(train_set), world.size)
    params = recipe.params  # every `auto` replaced by its value from here on
    log.info("recipe: %s", recipe.summary())
    for reason in recipe.reasons():
        log.info("  %s", reason)
    val = ShardSplit.open(shard_dir, "val")
    val_images = val.all_images()
    generator = torch.Generator().manual_seed(derive_seed(seed, "loader"))
    try:
        sampler = StepSampler(len(train_set), params.batch_size, world, generator)
    except ValueError as exc:
        raise StageError(f"{shard_dir}: {exc}; lower train.batch_size") from None
    loader = make_loader(train_set, sampler, num_workers=params.num_workers, pin_memory=device.type == "cuda",
                         generator=generator)  # fmt: skip

    model = build_model(params.arch, len(spec.class_names))
    transfer = load_init_weights(model, params.init_from) if params.init_from else None
    frozen = freeze_backbone(model) if params.freeze_backbone else []
    if frozen and transfer is None:
        log.warning("freeze_backbone without init_from: only the head of a randomly initialised backbone trains")
    precision = resolve_precision(params.precision, device)
    identity = run_identity(params, seed=seed, data_sha256=sha256_file(shard_dir / MANIFEST),
                            init_sha256=transfer["sha256"] if transfer else None, device_type=device.type)  # fmt: skip
    checkpointer = Checkpointer(checkpoint_dir / identity.name, identity, faults)
    model.to(device)
    ddp = None
    if world.is_distributed:
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    wrapped: torch.nn.Module = ddp if ddp is not None else model
    if params.compile:
        wrapped = torch.compile(wrapped)  # checkpoints hold the unwrapped module's keys: load either way
    optimizer = build_optimizer(model, params)
    schedule = Schedule(optimizer, params, sampler.steps_per_epoch)

    payload = None
    if params.resume:
        payload = checkpointer.load()
    elif world.is_main:
        checkpointer.discard()
    run_dir = runs_dir / "train" / identity.name
    purge = payload["progress"]["step"] + 1 if payload else None  # TensorBoard drops the steps redone
    monitor = Monitor(run_dir, enabled=world.is_main, histogram_every=params.histogram_every_steps, purge_step=purge)
    trainer = Trainer(
        model=wrapped, ddp=ddp, optimizer=optimizer, schedule=schedule, precision=precision, params=params,
        spec=spec, device=device, world=world, monitor=monitor, faults=faults,
    )  # fmt: skip
    progress = Progress(accumulation=params.accumulation_steps)
    if payload is not None:
        progress = trainer.restore(payload, generator)
        log.info("resuming from %s: step %d of %d (epoch %d, batch %d of %d)", checkpointer.last, progress.step,
                 params.epochs * sampler.steps_per_epoch, progress.epoch + 1, progress.batch_in_epoch,
                 sampler.steps_per_epoch)  # fmt: skip
    resumed_from = progress.step
    log.info("run %s: %s, %s on %s, %d process(es), global batch %d = %d x %d accumulation x %d",
             identity.name, params.arch, precision.name, device, world.size, params.batch_size,
             params.batch_size // (world.size * progress.accumulation), progress.accumulation, world.size)  # fmt: skip
    try:
        progress = trainer.fit(
            loader=loader, sampler=sampler, dataset=train_set, generator=generator, progress=progress,
            checkpointer=checkpointer,
            validate=lambda m: validate(m, val_images, val.labels, spec, world),
        )  # fmt: skip
    finally:
        profile = monitor.profile(num_workers=params.num_workers, device_type=device.type)
        monitor.close()
    in_sync = None
    if world.is_distributed:
        in_sync = len(set(distributed.all_gather_objects(state_sha256(trainer.raw)))) == 1
        if not in_sync:
            log.error("the ranks' weights differ at the end of training: DDP did not keep them in sync")
    if world.is_main:
        prov = {**provenance, **({"init_from_sha256": transfer["sha256"]} if transfer else {})}
        save_model_file(model_path, trainer.raw, arch=params.arch, spec=spec, provenance=prov)
        write_json(history_path, progress.history)
        plot_history(progress.history, plot_path)
        meta = run_metadata(params, recipe, identity, precision, world, sampler, progress, transfer, frozen, in_sync)
        write_json(run_meta_path, meta)
        if profile["steps"]:  # a rerun of a finished run trains nothing: keep the real run's profile
            write_json(run_dir / "profile.json", {**profile, "resumed_from_step": resumed_from})
        for folder in prune_runs(checkpoint_dir, keep=params.keep_checkpoint_runs, current=identity.name):
            log.info("removed the checkpoints of an older run: %s (train.keep_checkpoint_runs %d)",
                     folder, params.keep_checkpoint_runs)  # fmt: skip
    return TrainResult(model_path, progress.history[-1]["val_accuracy"], int(params.epochs),
                       profile["images_per_second"], resumed_from, checkpointer.directory)  # fmt: skip


def run_metadata(
    params: TrainParams,
    recipe: Recipe,
    identity: RunIdentity,
    precision: Precision,
    world: distributed.World,
    sampler: StepSampler,
    progress: Progress,
    transfer: dict[str, Any] | None,
    frozen: list[str],
    in_sync: bool | None,
) -> dict[str, Any]:
    """What this run did, deterministically (no wall-clock): the same run gives the same bytes."""
    return {
        "run": identity.name,
        "params_sha256": identity.params_sha256,
        "data_sha256": identity.data_sha256,
        "recipe": recipe.to_json(),
        "device": precision.device_type,
        "precision": precision.name,
        "processes": world.size,
        "global_batch": params.batch_size,
        "accumulation_steps": progress.accumulation,
        "micro_batch": params.batch_size // (world.size * progress.accumulation),
        "steps_per_epoch": sampler.steps_per_epoch,
        "steps": progress.step,
        "optimizer_updates": progress.updates,
        "scaler_skipped_steps": progress.scaler_skipped,
        "nonfinite_steps": progress.nonfinite,
        "auto_batch": progress.auto_batch,
        "init_from": transfer,
        "frozen_parameters": len(frozen),
        "best": {"metric": params.monitor, "value": progress.best, "epoch": progress.best_epoch},
        "coverage": progress.coverage,
        "ranks_in_sync": in_sync,
    }


def _main(p: Params) -> None:
    if distributed.needs_launch(p.train.nproc_per_node):
        status = distributed.launch(p.train.nproc_per_node, "tasks.train")
        if status:
            raise StageError(f"torchrun exited with status {status}; the ranks' messages are above")
        return
    shard_dir = p.paths.shards
    result = run(
        p.train,
        seed=p.seed,
        shard_dir=shard_dir,
        model_path=p.paths.model,
        history_path=p.paths.reports / "train_history.json",
        plot_path=p.paths.reports / "train_curves.png",
        runs_dir=p.paths.runs,
        checkpoint_dir=p.paths.checkpoints,
        run_meta_path=p.paths.reports / "train_run.json",
        provenance={
            "params_sha256": section_hash(p.train),
            "seed": str(p.seed),
            "data_manifest_sha256": sha256_file(shard_dir / MANIFEST),
        },
    )
    log.info("model -> %s (val accuracy %.4f, %.0f img/s; checkpoints in %s)", result.model_path,
             result.val_accuracy, result.images_per_second, result.run_dir)  # fmt: skip


def main() -> None:
    stage_main("train", _main)


if __name__ == "__main__":
    main()
