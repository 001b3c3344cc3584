"""Stage train: train shards -> models/model.pt (weights + spec + provenance), per-epoch history + plot,
reports/train_run.json (what the run did); checkpoints and TensorBoard logs under paths.runs.

Seeded end to end with deterministic algorithms: the same params and shards give the same weights,
also when the run was killed and rerun (it resumes from its last checkpoint). Read top to bottom:
`run` -> `_train`, which sets up the data, the model and the optimizer in named functions and hands
them to the epoch loop (tasks/training/loop.py) and its step runner (tasks/training/step.py).
train.nproc_per_node > 1 or train.nnodes > 1 reruns this module under torchrun; on another node of
a multi-node job, `python -m tasks.train --join` (make train-join) starts this node's part.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tasks.core.cli import stage_main
from tasks.core.errors import StageError
from tasks.core.io import sha256_file, write_json
from tasks.core.params import Params, Paths, TrainParams, derive_seed, section_hash
from tasks.core.plots import plot_history
from tasks.images.imaging import PreprocessSpec
from tasks.images.shards import MANIFEST, ShardSplit, load_manifest
from tasks.training import distributed
from tasks.training.augment import Augment
from tasks.training.batches import first_batch, write_batch_grids
from tasks.training.checkpoint import Checkpointer, RunIdentity, prune_runs, run_identity
from tasks.training.dataset import ShardDataset
from tasks.training.dynamics import Dynamics
from tasks.training.hooks import Hooks, hooks_from_env, planted
from tasks.training.loader import StepSampler, make_loader
from tasks.training.loop import EpochLoop, Progress, validate
from tasks.training.models import build_model, save_model_file
from tasks.training.optim import Schedule, build_optimizer, freeze_backbone
from tasks.training.precision import Precision, resolve_precision
from tasks.training.pretrained import start_weights
from tasks.training.recipe import Recipe, resolve
from tasks.training.runtime import cpu_threads, seed_everything, warn_if_cores_busy
from tasks.training.step import StepRunner, StepStats
from tasks.training.telemetry import Telemetry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    model_path: Path
    val_accuracy: float
    epochs: int
    images_per_second: float
    resumed_from_step: int  # 0: started fresh
    run_dir: Path  # this run's checkpoints


@dataclass(frozen=True)
class Outputs:
    """Where one training run reads its shards and writes everything it makes."""

    shard_dir: Path
    model: Path
    history: Path
    plot: Path
    run_meta: Path
    dynamics: Path  # per training image: the area under the margin (tasks/training/dynamics.py)
    train_batch: Path  # grids of what the model sees (tasks/training/batches.py)
    val_batch: Path
    runs: Path  # TensorBoard logs and profile: <runs>/train/<run>
    checkpoints: Path  # <checkpoints>/<run>/last.pt, best.pt
    pretrained: Path  # train.pretrained's weights files (paths.pretrained)


@dataclass(frozen=True)
class Data:
    train_set: ShardDataset
    sampler: StepSampler
    loader: torch.utils.data.DataLoader
    generator: torch.Generator
    val_images: np.ndarray
    val_labels: np.ndarray


@dataclass(frozen=True)
class Model:
    module: torch.nn.Module  # unwrapped, on the device
    wrapped: torch.nn.Module  # what the step calls: DDP and/or torch.compile around `module`
    ddp: torch.nn.parallel.DistributedDataParallel | None
    transfer: dict[str, Any] | None
    frozen: list[str]


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
    hooks: Hooks | None = None,
    pretrained_dir: Path | None = None,
) -> TrainResult:
    names = Paths()
    outputs = Outputs(
        shard_dir, model_path, history_path, plot_path, run_meta_path or history_path.with_name(names.train_run.name),
        history_path.with_name(names.train_dynamics.name), history_path.with_name(names.train_batch_png.name),
        history_path.with_name(names.val_batch_png.name),
        runs_dir, checkpoint_dir or runs_dir / "checkpoints", pretrained_dir or names.pretrained,
    )  # fmt: skip
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
        _same_on_every_rank(provenance, world)
        _checkpoints_shared(outputs.checkpoints, world)
        started = True
        return _train(params, seed, outputs, provenance, world, device, hooks or hooks_from_env())
    except RuntimeError as exc:  # gloo says "Connection reset by peer" as a RuntimeError, nccl as a DistError
        if not (started and world.is_distributed and _lost_peer(exc)):
            raise
        said = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
        rerun = ("on the head `dvc repro train`, on the others `make train-join`" if distributed.nodes() > 1
                 else "`dvc repro train`")  # fmt: skip
        raise StageError(
            f"lost contact with another rank ({said}); the job stops on every rank. Rerun it ({rerun}): it resumes "
            f"from the last checkpoint every rank reached, in {outputs.checkpoints}"
        ) from None
    finally:
        distributed.shutdown()


def _lost_peer(exc: RuntimeError) -> bool:
    """A collective that failed because another rank's process is gone, not a bug in this one."""
    return isinstance(exc, torch.distributed.DistError) or "/gloo/transport/" in str(exc)


def _code_sha256() -> str:
    """The tasks/ package's Python files: what every rank runs."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _same_on_every_rank(provenance: dict[str, str], world: distributed.World) -> None:
    """Every rank must train with the same code, params, seed and shards: a node on another commit or with
    other data would silently train something else. Named by host and folder, so the odd node is found."""
    if not world.is_distributed:
        return
    compared = {**provenance, "code (tasks/) sha256": _code_sha256()}
    mine = {"host": socket.gethostname(), "folder": str(Path.cwd()), **compared}
    everyone = distributed.all_gather_objects(mine)
    for rank, theirs in enumerate(everyone):
        differ = [key for key in compared if theirs[key] != everyone[0][key]]
        if differ:
            raise StageError(
                f"rank {rank} ({theirs['host']}:{theirs['folder']}) has other {', '.join(differ)} than rank 0 "
                f"({everyone[0]['host']}:{everyone[0]['folder']}): "
                + "; ".join(f"{key} {theirs[key][:12]} vs {everyone[0][key][:12]}" for key in differ)
                + ". Every node needs the same commit and data: `git checkout <commit> && dvc pull` there"
            )


def _train(
    params: TrainParams, seed: int, out: Outputs, provenance: dict[str, str], world: distributed.World,
    device: torch.device, hooks: Hooks,
) -> TrainResult:  # fmt: skip
    seed = derive_seed(seed, "train")
    threads = cpu_threads(params.threads, world.local_size)
    if world.is_main and device.type == "cpu":
        warn_if_cores_busy(threads, world.local_size)
    seed_everything(seed, threads, device)
    spec = PreprocessSpec.model_validate(load_manifest(out.shard_dir)["spec"])
    train_set = ShardDataset(out.shard_dir, "train", augment=Augment(params.augment), seed=seed)
    recipe = resolve(params, len(train_set), world.size)
    params = recipe.params  # every `auto` replaced by its value from here on
    log.info("recipe: %s", recipe.summary())
    for reason in recipe.reasons():
        log.info("  %s", reason)
    data = _setup_data(params, train_set, out.shard_dir, seed, world, device)
    epoch_one = data.generator.get_state()  # before a resume moves it: the grid shows the first batch
    model = _setup_model(params, spec, out.pretrained, world, device)
    precision = resolve_precision(params.precision, device)
    identity = run_identity(params, seed=seed, data_sha256=sha256_file(out.shard_dir / MANIFEST),
                            init_sha256=model.transfer["sha256"] if model.transfer else None,
                            device_type=device.type, precision=precision.name)  # fmt: skip
    checkpointer = Checkpointer(out.checkpoints / identity.name, identity, hooks)
    optimizer = build_optimizer(model.module, params)
    schedule = Schedule(optimizer, params, data.sampler.steps_per_epoch)

    payload = checkpointer.load() if params.resume else None
    _same_checkpoint_on_every_rank(checkpointer, payload, world)
    if not params.resume and world.is_main:
        checkpointer.discard()
    run_dir = out.runs / "train" / identity.name
    purge = payload["progress"]["step"] + 1 if payload else None  # TensorBoard drops the steps redone
    telemetry = Telemetry(run_dir, enabled=world.is_main, histogram_every=params.histogram_every_steps,
                          purge_step=purge)  # fmt: skip
    if world.is_main:
        write_batch_grids(train=first_batch(data.train_set, params.batch_size, epoch_one),
                          val=(data.val_images, data.val_labels), class_names=spec.class_names,
                          augment=params.augment, train_png=out.train_batch, val_png=out.val_batch,
                          telemetry=telemetry)  # fmt: skip
    runner = StepRunner(
        model=model.wrapped, ddp=model.ddp, optimizer=optimizer, schedule=schedule, precision=precision,
        params=params, spec=spec, device=device, world=world, telemetry=telemetry, hooks=hooks,
    )  # fmt: skip
    loop = EpochLoop(runner, checkpointer=checkpointer, generator=data.generator, dynamics_samples=len(train_set))
    if payload is not None:
        progress = loop.restore(payload)
        log.info("resuming from %s: step %d of %d (epoch %d, batch %d of %d)", checkpointer.last, progress.step,
                 params.epochs * data.sampler.steps_per_epoch, progress.epoch + 1, progress.batch_in_epoch,
                 data.sampler.steps_per_epoch)  # fmt: skip
    resumed_from = loop.progress.step
    accumulation = runner.stats.accumulation
    log.info("run %s: %s, %s on %s, %d process(es), global batch %d = %d x %d accumulation x %d",
             identity.name, params.arch, precision.name, device, world.size, params.batch_size,
             params.batch_size // (world.size * accumulation), accumulation, world.size)  # fmt: skip
    try:
        progress = loop.fit(loader=data.loader, sampler=data.sampler, dataset=data.train_set,
                            validate=lambda m: validate(m, data.val_images, data.val_labels, spec, world))  # fmt: skip
    finally:
        profile = telemetry.profile(num_workers=params.num_workers, device_type=device.type)
        telemetry.close()
    in_sync = _ranks_in_sync(model.module, world)
    dynamics = loop.dynamics.reduced()
    if world.is_main:
        write_json(out.dynamics, Dynamics.to_json(dynamics))
        meta = run_metadata(params, recipe, identity, precision, world, data.sampler, progress, runner.stats,
                            model, in_sync)  # fmt: skip
        meta["test_hooks"] = planted(hooks)  # never promoted: make promote and make commit-run refuse it
        _write_outputs(out, params, spec, model, provenance, progress, meta)
        if profile["steps"]:  # a rerun of a finished run trains nothing: keep the real run's profile
            write_json(run_dir / "profile.json", {**profile, "resumed_from_step": resumed_from})
        for folder in prune_runs(out.checkpoints, keep=params.keep_checkpoint_runs, current=identity.name):
            log.info("removed the checkpoints of an older run: %s (train.keep_checkpoint_runs %d)",
                     folder, params.keep_checkpoint_runs)  # fmt: skip
    return TrainResult(out.model, progress.history[-1]["val_accuracy"], int(params.epochs),
                       profile["images_per_second"], resumed_from, checkpointer.directory)  # fmt: skip


def _checkpoints_shared(folder: Path, world: distributed.World) -> None:
    """On several nodes, paths.checkpoints must be one folder: rank 0 writes a marker there, and every
    rank must see it. Checked at the start, so a fresh run fails now rather than its resume later."""
    if not world.is_distributed or distributed.nodes() == 1:
        return
    marker = folder / f".shared-{distributed.all_gather_objects(uuid.uuid4().hex)[0]}"
    if world.is_main:
        folder.mkdir(parents=True, exist_ok=True)
        marker.write_text(socket.gethostname())
    distributed.barrier()
    seen = distributed.all_gather_objects((socket.gethostname(), marker.is_file()))
    distributed.barrier()
    if world.is_main:
        marker.unlink(missing_ok=True)
    blind = [(rank, host) for rank, (host, ok) in enumerate(seen) if not ok]
    if blind:
        rank, host = blind[0]
        raise StageError(
            f"rank {rank} ({host}) does not see {marker.name}, which rank 0 ({seen[0][0]}) just wrote in {folder}: "
            "paths.checkpoints must be one folder that every node sees (shared storage: NFS, a cluster file system)"
        )


def _same_checkpoint_on_every_rank(
    checkpointer: Checkpointer, payload: dict[str, Any] | None, world: distributed.World
) -> None:
    """A rank that resumes from another step than rank 0 (or starts fresh while rank 0 resumes) would
    train out of step: on several nodes it means the checkpoint folder is not one shared folder."""
    if not world.is_distributed:
        return
    step = payload["progress"]["step"] if payload else None
    steps = distributed.all_gather_objects((socket.gethostname(), str(checkpointer.directory), step))
    odd = [(rank, *item) for rank, item in enumerate(steps) if item[2] != steps[0][2]]
    if odd:
        rank, host, folder, theirs = odd[0]
        raise StageError(
            f"rank {rank} ({host}) finds {'no checkpoint' if theirs is None else f'a checkpoint at step {theirs}'} "
            f"in {folder}, rank 0 ({steps[0][0]}) {'none' if steps[0][2] is None else f'one at step {steps[0][2]}'}: "
            "paths.checkpoints must be one folder that every node sees (shared storage: NFS, a cluster file system)"
        )


def _write_outputs(
    out: Outputs, params: TrainParams, spec: PreprocessSpec, model: Model, provenance: dict[str, str],
    progress: Progress, meta: dict[str, Any],
) -> None:  # fmt: skip
    """model.pt (weights + spec + provenance), the history and its plot, train_run.json: the stage's outs."""
    prov = dict(provenance)
    if model.transfer and "weights" in model.transfer:  # train.pretrained
        prov.update(pretrained=model.transfer["weights"], pretrained_sha256=model.transfer["sha256"],
                    pretrained_published_file=str(model.transfer["published_file"]).lower())  # fmt: skip
    elif model.transfer:
        prov["init_from_sha256"] = model.transfer["sha256"]
    if meta.get("test_hooks"):
        prov["test_hooks"] = meta["test_hooks"]
    save_model_file(out.model, model.module, arch=params.arch, spec=spec, provenance=prov)
    write_json(out.history, progress.history)
    plot_history(progress.history, out.plot)
    write_json(out.run_meta, meta)


def _setup_data(
    params: TrainParams, train_set: ShardDataset, shard_dir: Path, seed: int, world: distributed.World,
    device: torch.device,
) -> Data:  # fmt: skip
    """The training loader (seeded sample order, this rank's part of each global batch) and the val split."""
    val = ShardSplit.open(shard_dir, "val")
    val_images = val.all_images()
    generator = torch.Generator().manual_seed(derive_seed(seed, "loader"))
    try:
        sampler = StepSampler(len(train_set), params.batch_size, world, generator)
    except ValueError as exc:
        raise StageError(f"{shard_dir}: {exc}; lower train.batch_size") from None
    loader = make_loader(train_set, sampler, num_workers=params.num_workers, pin_memory=device.type == "cuda",
                         generator=generator)  # fmt: skip
    return Data(train_set, sampler, loader, generator, val_images, val.labels)


def _setup_model(
    params: TrainParams, spec: PreprocessSpec, pretrained_dir: Path, world: distributed.World, device: torch.device
) -> Model:
    """The architecture, the weights it starts from and frozen layers, on the device, wrapped for DDP and compile."""
    model = build_model(params.arch, len(spec.class_names))
    transfer = start_weights(model, params, spec, pretrained_dir)
    frozen = freeze_backbone(model) if params.freeze_backbone else []
    if frozen and transfer is None:
        log.warning("freeze_backbone without pretrained or init_from: only the head of a random backbone trains")
    model.to(device)
    ddp = None
    if world.is_distributed:
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    wrapped: torch.nn.Module = ddp if ddp is not None else model
    if params.compile:
        wrapped = torch.compile(wrapped)  # checkpoints hold the unwrapped module's keys: load either way
    return Model(model, wrapped, ddp, transfer, frozen)


def _ranks_in_sync(model: torch.nn.Module, world: distributed.World) -> bool | None:
    if not world.is_distributed:
        return None
    in_sync = len(set(distributed.all_gather_objects(state_sha256(model)))) == 1
    if not in_sync:
        log.error("the ranks' weights differ at the end of training: DDP did not keep them in sync")
    return in_sync


def run_metadata(
    params: TrainParams, recipe: Recipe, identity: RunIdentity, precision: Precision, world: distributed.World,
    sampler: StepSampler, progress: Progress, stats: StepStats, model: Model, in_sync: bool | None,
) -> dict[str, Any]:  # fmt: skip
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
        "accumulation_steps": stats.accumulation,
        "micro_batch": params.batch_size // (world.size * stats.accumulation),
        "steps_per_epoch": sampler.steps_per_epoch,
        "steps": progress.step,
        "optimizer_updates": stats.updates,
        "scaler_skipped_steps": stats.scaler_skipped,
        "nonfinite_steps": stats.nonfinite,
        "auto_batch": stats.auto_batch,
        "init_from": model.transfer if model.transfer and "weights" not in model.transfer else None,
        "pretrained": model.transfer if model.transfer and "weights" in model.transfer else None,
        "frozen_parameters": len(model.frozen),
        "best": {"metric": params.monitor, "value": progress.best, "epoch": progress.best_epoch},
        "coverage": progress.coverage,
        "ranks_in_sync": in_sync,
    }


def _main(p: Params, *, join: bool = False) -> None:
    t = p.train
    if join and t.nnodes == 1:
        raise StageError("--join: train.nnodes is 1 in params.yaml, so there is no multi-node job to join")
    if distributed.needs_launch(t.nproc_per_node, t.nnodes):
        if t.nnodes > 1:
            log.info("%s node of %d, %d process(es) each, rendezvous at %s (waiting up to %d s for the others)",
                     "joining as another" if join else "head", t.nnodes, t.nproc_per_node, t.rdzv_endpoint,
                     t.rdzv_timeout_s)  # fmt: skip
        command = distributed.torchrun_command(t.nproc_per_node, "tasks.train", nnodes=t.nnodes, head=not join,
                                               endpoint=t.rdzv_endpoint, timeout_s=t.rdzv_timeout_s)  # fmt: skip
        status = distributed.launch(command, head=not join, timeout_s=t.rdzv_timeout_s)
        if status:
            where = "" if t.nnodes == 1 else f" on the {'joining' if join else 'head'} node"
            raise StageError(f"torchrun exited with status {status}{where}; the ranks' messages are above")
        return
    if join:
        raise StageError("--join is for the node's own launcher, not for a process torchrun started")
    shard_dir = p.paths.shards
    result = run(
        p.train,
        seed=p.seed,
        shard_dir=shard_dir,
        model_path=p.paths.model,
        history_path=p.paths.train_history,
        plot_path=p.paths.train_curves,
        runs_dir=p.paths.runs,
        checkpoint_dir=p.paths.checkpoints,
        run_meta_path=p.paths.train_run,
        pretrained_dir=p.paths.pretrained,
        provenance={
            "params_sha256": section_hash(p.train),
            "seed": str(p.seed),
            "data_manifest_sha256": sha256_file(shard_dir / MANIFEST),
        },
    )
    log.info("model -> %s (val accuracy %.4f, %.0f img/s; checkpoints in %s)", result.model_path,
             result.val_accuracy, result.images_per_second, result.run_dir)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tasks.train", description="The train stage (dvc repro train).")
    parser.add_argument("--join", action="store_true",
                        help="train.nnodes > 1: join the job the head node started (make train-join)")  # fmt: skip
    args = parser.parse_args()
    stage_main("train", lambda p: _main(p, join=args.join))


if __name__ == "__main__":
    main()
