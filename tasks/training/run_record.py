"""The train stage's outputs once the loop is done: model.pt (weights + spec + provenance + temperature), the
per-epoch history and its plot, and reports/train_run.json, the record of what the run did.

The record is deterministic (no wall-clock, no host): the same run gives the same bytes, so DVC and
`make check-reproduced` can compare it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tasks.core.io import write_json
from tasks.core.params import Paths, TrainParams
from tasks.core.plots import plot_history
from tasks.images.imaging import PreprocessSpec
from tasks.training.distributed import World
from tasks.training.identity import RunIdentity
from tasks.training.loader import StepSampler
from tasks.training.loop import Progress
from tasks.training.models import save_model_file
from tasks.training.precision import Precision
from tasks.training.recipe import Recipe
from tasks.training.start import Built
from tasks.training.step import StepStats
from tasks.training.temperature import TemperatureFit


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
    parent: Path  # train.warm_start's parent model (paths.parent)
    environment: Path  # the train stage's environment record: part of the run identity (tasks/training/identity.py)

    @classmethod
    def beside(
        cls, shard_dir: Path, model: Path, history: Path, plot: Path, runs: Path, checkpoints: Path | None = None,
        run_meta: Path | None = None, pretrained: Path | None = None, parent: Path | None = None,
    ) -> Outputs:  # fmt: skip
        """The reports the stage writes beside `history` under their paths.* names; checkpoints under `runs`."""
        names = Paths()
        return cls(
            shard_dir, model, history, plot, run_meta or history.with_name(names.train_run.name),
            history.with_name(names.train_dynamics.name), history.with_name(names.train_batch_png.name),
            history.with_name(names.val_batch_png.name), runs, checkpoints or runs / "checkpoints",
            pretrained or names.pretrained, parent or names.parent,
            Paths(reports=history.parent).environment_record("train"),
        )  # fmt: skip


def run_metadata(
    params: TrainParams, recipe: Recipe, identity: RunIdentity, precision: Precision, world: World,
    sampler: StepSampler, progress: Progress, stats: StepStats, model: Built, in_sync: bool | None,
    test_hooks: dict[str, str] | None,
) -> dict[str, Any]:  # fmt: skip
    """What this run did (train_run.json)."""
    return {
        "run": identity.name,
        "params_sha256": identity.params_sha256,
        "data_sha256": identity.data_sha256,
        "code_sha256": identity.code_sha256,  # the train stage's code files (dvc.yaml's deps), each md5 as dvc.lock
        "environment_sha256": identity.environment_sha256,  # libraries, CPU capability, threads
        "recipe": recipe.to_json(),
        "device": precision.device_type,
        "precision": precision.name,
        "memory_format": precision.memory_format,
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
        "init_from": model.transfer if _kind(model.transfer) == "init_from" else None,
        "pretrained": model.transfer if _kind(model.transfer) == "pretrained" else None,
        "warm_start": model.transfer["warm_start"] if _kind(model.transfer) == "warm_start" else None,
        "frozen_parameters": len(model.frozen),
        "best": {"metric": params.monitor, "value": progress.best, "epoch": progress.best_epoch},
        "coverage": progress.coverage,
        "ranks_in_sync": in_sync,
        "test_hooks": test_hooks,  # never promoted: make promote and make commit-run refuse it
    }


def _kind(transfer: dict[str, Any] | None) -> str | None:
    """Which start a transfer record is: pretrained (published weights), warm_start (the parent), init_from."""
    if not transfer:
        return None
    return "pretrained" if "weights" in transfer else "warm_start" if "warm_start" in transfer else "init_from"


def model_provenance(provenance: dict[str, str], model: Built, test_hooks: dict[str, str] | None) -> dict[str, Any]:
    """What model.pt says it came from: the params, seed and shards, the weights it started from, test hooks."""
    prov: dict[str, Any] = dict(provenance)
    kind = _kind(model.transfer)
    if kind == "pretrained":
        prov.update(pretrained=model.transfer["weights"], pretrained_sha256=model.transfer["sha256"],
                    pretrained_published_file=str(model.transfer["published_file"]).lower())  # fmt: skip
    elif kind == "warm_start":  # the lineage: the production model this one grew from
        lineage = model.transfer["warm_start"]
        prov.update(parent_model_sha256=lineage["parent_model_sha256"],
                    parent_onnx_sha256=str(lineage["parent_onnx_sha256"]),
                    warm_start=f"shrink {lineage['shrink']:g}, perturb {lineage['perturb']:g}")  # fmt: skip
    elif kind == "init_from":
        prov["init_from_sha256"] = model.transfer["sha256"]
    if test_hooks:
        prov["test_hooks"] = test_hooks
    return prov


def write_outputs(
    out: Outputs, *, module: torch.nn.Module, arch: str, spec: PreprocessSpec, provenance: dict[str, Any],
    progress: Progress, meta: dict[str, Any], calibration: TemperatureFit | None = None,
) -> None:  # fmt: skip
    """model.pt, the history and its plot, train_run.json: the stage's outs, each written atomically. Both files
    record `calibration`, the temperature export folds into the ONNX (tasks/training/temperature.py)."""
    fitted = calibration.to_json() if calibration is not None else None
    save_model_file(out.model, module, arch=arch, spec=spec, provenance=provenance, calibration=fitted)
    write_json(out.history, progress.history)
    plot_history(progress.history, out.plot)
    write_json(out.run_meta, {**meta, "calibration": fitted} if fitted is not None else meta)
