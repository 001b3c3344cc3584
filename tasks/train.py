"""Stage train: train shards -> models/model.pt (weights + spec + provenance), per-epoch history + plot,
reports/train_run.json (what the run did); checkpoints and TensorBoard logs under paths.runs.

Seeded end to end with deterministic algorithms: the same params and shards give the same weights,
also when the run was killed and rerun (it resumes from its last checkpoint). Read top to bottom:
`run` -> `_train`: the starting point (tasks/training/start.py: data, model, optimizer, schedule),
the checks every rank must pass (tasks/training/consistency.py), the epoch loop (tasks/training/loop.py)
and its step runner (tasks/training/step.py), then the record (tasks/training/run_record.py).
train.nproc_per_node > 1 or train.nnodes > 1 reruns this module under torchrun; on another node of
a multi-node job, `python -m tasks.train --join` (make train-join) starts this node's part.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tasks.core.cli import stage_main
from tasks.core.environment import NATIVE_BF16_ENV, cpu_facts_disagree
from tasks.core.errors import StageError
from tasks.core.io import sha256_file, write_json
from tasks.core.params import Params, TrainParams, derive_seed, section_hash
from tasks.images.shards import MANIFEST
from tasks.training import consistency, distributed
from tasks.training.batches import first_batch, write_batch_grids
from tasks.training.checkpoint import Checkpointer, prune_runs
from tasks.training.dynamics import Dynamics
from tasks.training.hooks import Hooks, hooks_from_env, planted
from tasks.training.identity import run_identity, stage_environment, train_code
from tasks.training.loop import EpochLoop, validate
from tasks.training.precision import Precision, cpu_has_native_bf16, resolve_precision
from tasks.training.run_record import Outputs, model_provenance, run_metadata, write_outputs
from tasks.training.runtime import cpu_threads, seed_everything, warn_if_cores_busy
from tasks.training.start import Built, Data, Start, training_start
from tasks.training.step import StepRunner
from tasks.training.telemetry import Telemetry
from tasks.training.temperature import calibrate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    model_path: Path
    val_accuracy: float
    epochs: int
    images_per_second: float
    resumed_from_step: int  # 0: started fresh
    run_dir: Path  # this run's checkpoints


def run(
    params: TrainParams, *, seed: int, shard_dir: Path, model_path: Path, history_path: Path, plot_path: Path,
    runs_dir: Path, provenance: dict[str, str], checkpoint_dir: Path | None = None, run_meta_path: Path | None = None,
    hooks: Hooks | None = None, pretrained_dir: Path | None = None, parent_dir: Path | None = None,
) -> TrainResult:  # fmt: skip
    outputs = Outputs.beside(shard_dir, model_path, history_path, plot_path, runs_dir, checkpoint_dir, run_meta_path,
                             pretrained_dir, parent_dir)  # fmt: skip
    world = distributed.world_from_env()
    try:
        device = distributed.resolve_device(params.device, world)
    except RuntimeError as exc:
        raise StageError(str(exc)) from None
    started = False  # a collective that fails before this is a set-up problem, not a lost rank
    try:
        world = distributed.init(world, device)  # on several nodes the ranks are renumbered: head first
        if not world.is_main:  # one voice: the other ranks report only warnings and errors
            logging.getLogger().setLevel(logging.WARNING)
        consistency.same_inputs(provenance, world)
        consistency.checkpoints_shared(outputs.checkpoints, world)
        started = True
        return _train(params, seed, outputs, provenance, world, device, hooks or hooks_from_env())
    except RuntimeError as exc:
        if not (started and world.is_distributed and distributed.lost_peer(exc)):
            raise
        raise StageError(distributed.lost_peer_message(exc, outputs.checkpoints)) from None
    finally:
        distributed.shutdown()


@dataclass(frozen=True)
class Setup:
    """Everything one run trains with, built before step 1 (or the resumed step)."""

    start: Start
    data: Data
    precision: Precision
    built: Built
    runner: StepRunner
    checkpointer: Checkpointer
    telemetry: Telemetry
    payload: dict[str, Any] | None  # the checkpoint resumed from


def _train(
    params: TrainParams, seed: int, out: Outputs, provenance: dict[str, str], world: distributed.World,
    device: torch.device, hooks: Hooks,
) -> TrainResult:  # fmt: skip
    run = _setup(params, seed, out, world, device, hooks)
    params, spec, data, checkpointer = run.start.params, run.start.spec, run.data, run.checkpointer
    loop = EpochLoop(run.runner, checkpointer=checkpointer, generator=data.generator,
                     dynamics_samples=len(run.start.dataset))  # fmt: skip
    if run.payload is not None:
        progress = loop.restore(run.payload)
        log.info("resuming from %s: step %d of %d (epoch %d, batch %d of %d)", checkpointer.last, progress.step,
                 params.epochs * data.sampler.steps_per_epoch, progress.epoch + 1, progress.batch_in_epoch,
                 data.sampler.steps_per_epoch)  # fmt: skip
    resumed_from = loop.progress.step
    try:
        progress = loop.fit(loader=data.loader, sampler=data.sampler, dataset=run.start.dataset,
                            validate=lambda m: validate(m, data.val, data.val.labels, spec, world))  # fmt: skip
    finally:
        profile = run.telemetry.profile(num_workers=params.num_workers, device_type=device.type)
        run.telemetry.close()
    in_sync = consistency.weights_in_sync(run.built.module, world)
    dynamics = loop.dynamics.reduced()
    if world.is_main:
        write_json(out.dynamics, Dynamics.to_json(dynamics))
        test_hooks = planted(hooks)
        meta = run_metadata(params, run.start.recipe, checkpointer.identity, run.precision, world, data.sampler,
                            progress, run.runner.stats, run.built, in_sync, test_hooks)  # fmt: skip
        fit = calibrate(run.runner.kept, data.val, data.val.labels, spec, enabled=params.calibrate)
        write_outputs(out, module=run.runner.kept, arch=params.arch, spec=spec, progress=progress, meta=meta,
                      provenance=model_provenance(provenance, run.built, test_hooks), calibration=fit)  # fmt: skip
        if profile["steps"]:  # a rerun of a finished run trains nothing: keep the real run's profile
            write_json(run.telemetry.directory / "profile.json", {**profile, "resumed_from_step": resumed_from})
        for folder in prune_runs(out.checkpoints, keep=params.keep_checkpoint_runs, current=checkpointer.identity.name):
            log.info("removed the checkpoints of an older run: %s (train.keep_checkpoint_runs %d)",
                     folder, params.keep_checkpoint_runs)  # fmt: skip
    return TrainResult(out.model, progress.history[-1]["val_accuracy"], int(params.epochs),
                       profile["images_per_second"], resumed_from, checkpointer.directory)  # fmt: skip


def _setup(
    params: TrainParams, seed: int, out: Outputs, world: distributed.World, device: torch.device, hooks: Hooks
) -> Setup:
    """The starting point on the device, the checkpoint it resumes from, the step runner and the logs."""
    threads = cpu_threads(params.threads, world.local_size)
    if world.is_main and device.type == "cpu":
        warn_if_cores_busy(threads, world.local_size)
    seed_everything(derive_seed(seed, "train"), threads, device)
    start = training_start(params, seed=seed, shard_dir=out.shard_dir, pretrained_dir=out.pretrained,
                           world_size=world.size, parent_dir=out.parent)  # fmt: skip
    params, spec = start.params, start.spec  # every `auto` replaced by its value from here on
    log.info("recipe: %s", start.recipe.summary())
    for reason in start.recipe.reasons():
        log.info("  %s", reason)
    data = start.data(world, pin_memory=device.type == "cuda")
    epoch_one = data.generator.get_state()  # before a resume moves it: the grid shows the first batch
    built = start.model()
    precision = resolve_precision(params.precision, device, params.memory_format, model=built.module)
    if device.type == "cpu":  # the environment record was resolved from /proc/cpuinfo: torch must agree with it
        disagree = cpu_facts_disagree(torch.backends.cpu.get_cpu_capability(), cpu_has_native_bf16())
        if disagree:
            raise StageError(f"this CPU reads differently to torch and to the environment stage ({disagree}); set "
                             f"{NATIVE_BF16_ENV}=0 or 1 to pin it, and report the CPU model")  # fmt: skip
    precision.place(built.module.to(device))
    wrapped, ddp = distributed.wrap(built.module, world, device, compile=params.compile)
    identity = run_identity(params, seed=start.seed, data_sha256=sha256_file(out.shard_dir / MANIFEST),
                            init_sha256=built.transfer["sha256"] if built.transfer else None,
                            device_type=device.type, precision=precision.name,
                            memory_format=precision.memory_format, code=train_code(),
                            environment=stage_environment(out.environment))  # fmt: skip
    checkpointer = Checkpointer(out.checkpoints / identity.name, identity, hooks)
    optimizer, schedule = start.optimizer(built.module, steps_per_epoch=data.sampler.steps_per_epoch)
    payload = checkpointer.load() if params.resume else None
    if payload is None and params.resume and world.is_main:
        other = checkpointer.other_run()
        if other:
            log.info("training from step 0: no checkpoint of this run (%s); %s", identity.name, other)
    consistency.same_checkpoint(payload["progress"]["step"] if payload else None, checkpointer.directory, world)
    if not params.resume and world.is_main:
        checkpointer.discard()
    purge = payload["progress"]["step"] + 1 if payload else None  # TensorBoard drops the steps redone
    telemetry = Telemetry(out.runs / "train" / identity.name, enabled=world.is_main,
                          histogram_every=params.histogram_every_steps, purge_step=purge)  # fmt: skip
    if world.is_main:
        write_batch_grids(train=first_batch(start.dataset, params.batch_size, epoch_one, params.imbalance),
                          val=data.val, class_names=spec.class_names,
                          augment=params.augment, train_png=out.train_batch, val_png=out.val_batch,
                          telemetry=telemetry)  # fmt: skip
    runner = StepRunner(
        model=wrapped, ddp=ddp, optimizer=optimizer, schedule=schedule, precision=precision,
        params=params, spec=spec, device=device, world=world, telemetry=telemetry, hooks=hooks,
        class_counts=start.class_counts,
    )  # fmt: skip
    log.info("run %s: %s, %s (%s) on %s, %d process(es), global batch %d = %d x %d accumulation x %d",
             identity.name, params.arch, precision.name, precision.memory_format, device, world.size,
             params.batch_size, params.batch_size // (world.size * runner.stats.accumulation),
             runner.stats.accumulation, world.size)  # fmt: skip
    return Setup(start, data, precision, built, runner, checkpointer, telemetry, payload)


def _main(p: Params, *, join: bool = False) -> None:
    t = p.train
    try:
        if distributed.relaunch("tasks.train", nproc_per_node=t.nproc_per_node, nnodes=t.nnodes,
                                endpoint=t.rdzv_endpoint, timeout_s=t.rdzv_timeout_s, join=join):  # fmt: skip
            return
    except distributed.RelaunchError as exc:
        raise StageError(str(exc)) from None
    result = run(
        p.train, seed=p.seed, shard_dir=p.paths.shards, model_path=p.paths.model, history_path=p.paths.train_history,
        plot_path=p.paths.train_curves, runs_dir=p.paths.runs, checkpoint_dir=p.paths.checkpoints,
        run_meta_path=p.paths.train_run, pretrained_dir=p.paths.pretrained, parent_dir=p.paths.parent,
        provenance={"params_sha256": section_hash(p.train), "seed": str(p.seed),
                    "data_manifest_sha256": sha256_file(p.paths.shards / MANIFEST)},
    )  # fmt: skip
    log.info("model -> %s (val accuracy %.4f, %.0f img/s; checkpoints in %s)", result.model_path,
             result.val_accuracy, result.images_per_second, result.run_dir)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tasks.train", description="The train stage (dvc repro train).")
    parser.add_argument("--join", action="store_true",
                        help="train.nnodes > 1: join the job the head node started (make train-join)")  # fmt: skip
    args = parser.parse_args()
    stage_main("train", lambda p: _main(p, join=args.join), ledger=not args.join)


if __name__ == "__main__":
    main()
