"""train.warm_start: the next model starts from the production model's weights, shrunk and perturbed.

`make warm-start` (tasks/tools/warm_start.py) puts the production model's model.pt in paths.parent with
parent.json (its sha256, the ONNX it was exported to, where it came from) and `dvc add`s it; the train stage
depends on that folder, so dvc.lock records the parent and a second machine pulls the same file. With
train.warm_start.enabled the run loads every parent tensor whose name and shape match train.arch; the head's
rows are matched by class name, so a class the parent did not know starts at initialisation and a class the
data no longer has is dropped. Then every parameter becomes `shrink x parent + perturb x fresh`, where fresh is
the same parameter at this run's seeded initialisation (Ash & Adams, "On warm-starting neural network
training", NeurIPS 2020: a plain warm start, shrink 1 and perturb 0, generalises worse than training from
scratch; shrink-and-perturb closes the gap). BatchNorm's running statistics are the parent's. The recipe is
the from-scratch one (the same lr, schedule and budget); docs/benchmarks.md measures it against scratch.
The parent's sha256 is the model's lineage: model.pt's provenance (parent_model_sha256) and train_run.json.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from tasks.core.errors import StageError
from tasks.core.io import read_json, sha256_file
from tasks.core.params import WarmStartParams
from tasks.training.models import head_name

log = logging.getLogger(__name__)
PARENT_MODEL = "model.pt"
PARENT_RECORD = "parent.json"  # {model_sha256, onnx_sha256, source, arch, class_names}


class WarmStartError(StageError):
    """A parent model that cannot be started from; the message names the file and the fix."""


def load_parent(folder: Path) -> tuple[dict[str, Any], dict[str, Any], str]:
    """paths.parent's model.pt payload, its parent.json and sha256, after checking the two agree."""
    model, record = folder / PARENT_MODEL, folder / PARENT_RECORD
    fix = "`make warm-start` puts the production model there"
    if not model.is_file():
        tracked = model.with_name(model.name + ".dvc").is_file()
        why = f"is tracked by DVC but missing; run `dvc pull {model}.dvc`" if tracked else f"does not exist; {fix}"
        raise WarmStartError(f"train.warm_start: {model} {why}")
    if not record.is_file():
        raise WarmStartError(f"train.warm_start: {record} is missing beside {model}; {fix}")
    recorded = read_json(record)
    digest = sha256_file(model)
    if recorded.get("model_sha256") != digest:
        raise WarmStartError(f"train.warm_start: {model} has sha256 {digest[:16]}..., {record} records "
                             f"{str(recorded.get('model_sha256'))[:16]}...; {fix} again")  # fmt: skip
    payload = torch.load(model, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or not isinstance(payload.get("state_dict"), dict) or "spec" not in payload:
        raise WarmStartError(f"train.warm_start: {model} is not a model.pt (weights, spec and arch); {fix}")
    return payload, recorded, digest


def warm_start(
    module: torch.nn.Module, params: WarmStartParams, arch: str, class_names: list[str], folder: Path
) -> dict[str, Any]:
    """Load the parent into `module` (freshly initialised, seeded), shrink and perturb it; the lineage record."""
    payload, recorded, digest = load_parent(folder)
    if payload.get("arch") != arch:
        raise WarmStartError(f"train.warm_start: {folder / PARENT_MODEL} is a {payload.get('arch')} model, train.arch "
                             f"is {arch}; set train.arch to the parent's or turn warm_start off")  # fmt: skip
    parent = payload["state_dict"]
    parent_classes = list(payload["spec"]["class_names"])
    fresh = {key: value.detach().clone() for key, value in module.state_dict().items()}
    parameters = {name for name, _ in module.named_parameters()}
    head = head_name(module) + "."
    rows = [(i, parent_classes.index(name)) for i, name in enumerate(class_names) if name in parent_classes]
    state, skipped = {}, []
    for key, value in fresh.items():
        theirs = parent.get(key)
        if theirs is None or (tuple(theirs.shape) != tuple(value.shape) and not key.startswith(head)):
            skipped.append(key)
            state[key] = value
            continue
        if key.startswith(head):  # rows by class name: new classes keep their fresh rows, unshrunk
            mixed = value.clone()
            for mine, its in rows:
                mixed[mine] = params.shrink * theirs[its].to(value.dtype) + params.perturb * value[mine]
            state[key] = mixed
        elif key in parameters:
            state[key] = params.shrink * theirs.to(value.dtype) + params.perturb * value
        else:
            state[key] = theirs.to(value.dtype)  # BatchNorm's running statistics and counters
    if len(skipped) == len(fresh):
        raise WarmStartError(f"train.warm_start: no tensor of {folder / PARENT_MODEL} matches this {arch}")
    module.load_state_dict(state)
    new = [name for name in class_names if name not in parent_classes]
    dropped = [name for name in parent_classes if name not in class_names]
    log.info("warm start from %s (sha256 %s..., %s): shrink %g, perturb %g; %d of %d classes from the parent%s%s",
             folder / PARENT_MODEL, digest[:16], recorded.get("source", "?"), params.shrink, params.perturb,
             len(rows), len(class_names), f", new: {', '.join(new)}" if new else "",
             f", dropped: {', '.join(dropped)}" if dropped else "")  # fmt: skip
    for key in skipped:
        log.warning("train.warm_start: %s is not in the parent (or of another shape): left at initialisation", key)
    return {
        "path": str(folder / PARENT_MODEL),
        "sha256": digest,
        "warm_start": {
            "parent_model_sha256": digest,
            "parent_onnx_sha256": recorded.get("onnx_sha256"),
            "parent_source": recorded.get("source"),
            "shrink": params.shrink,
            "perturb": params.perturb,
            "classes_from_parent": len(rows),
            "new_classes": new,
            "dropped_classes": dropped,
            "fresh_tensors": skipped,
        },
    }
