"""What every rank of a distributed run must agree on, checked with one helper, `every_rank_agrees`:
the code, params, seed and shards it trains with; one shared checkpoint folder; the checkpoint it
resumes from; and, at the end, the weights. A node on another commit, with other data or its own
checkpoint folder would otherwise train something else without a word.

Each check gathers one small record per rank and names the first rank that differs from rank 0 by
host and folder, so the odd node is found. On one process every check passes without a collective.
"""

from __future__ import annotations

import hashlib
import logging
import re
import socket
import uuid
from pathlib import Path
from typing import Any

import torch

from tasks.core.errors import StageError
from tasks.core.provenance import code_sha256, declared_code, project_root
from tasks.training import distributed

log = logging.getLogger(__name__)

SHARED_FOLDER = "paths.checkpoints must be one folder that every node sees (shared storage: NFS, a cluster file system)"
SAME_COMMIT = "Every node needs the same commit and data: `git checkout <commit> && dvc pull` there"


def every_rank_agrees(
    values: dict[str, Any], world: distributed.World, *, fix: str, folder: Path | None = None
) -> None:
    """Every rank must hold the same `values` as rank 0; the first that does not stops the job on every rank.

    The error names that rank, its host and folder (`folder`, else the working directory), each differing
    key with both values (a sha256 cut to 12 characters), and `fix`."""
    if not world.is_distributed:
        return
    where = f"{socket.gethostname()}:{folder if folder is not None else Path.cwd()}"
    everyone = distributed.all_gather_objects((where, values))
    first_where, first = everyone[0]
    for rank, (theirs_where, theirs) in enumerate(everyone):
        differ = [key for key in values if theirs[key] != first[key]]
        if differ:
            raise StageError(
                f"rank {rank} ({theirs_where}) has other {', '.join(differ)} than rank 0 ({first_where}): "
                + "; ".join(f"{key} {_short(theirs[key])} vs {_short(first[key])}" for key in differ)
                + f". {fix}"
            )


def _short(value: Any) -> str:
    text = str(value)
    return text[:12] if re.fullmatch(r"[0-9a-f]{64}", text) else text


def same_inputs(provenance: dict[str, str], world: distributed.World) -> None:
    """The same code, params, seed and shards on every rank."""
    # every file train may load, not only those loaded so far: a rank whose lazily imported module differs stops now
    code = code_sha256(declared_code("train", project_root()))
    every_rank_agrees({**provenance, "code (train's tasks/ files) sha256": code}, world, fix=SAME_COMMIT)


def checkpoints_shared(folder: Path, world: distributed.World) -> None:
    """On several nodes paths.checkpoints must be one folder: rank 0 writes a marker there, and every rank
    must see it. Checked at the start, so a fresh run fails now rather than its resume later."""
    if not world.is_distributed or distributed.nodes() == 1:
        return
    marker = folder / f".shared-{distributed.all_gather_objects(uuid.uuid4().hex)[0]}"
    if world.is_main:
        folder.mkdir(parents=True, exist_ok=True)
        marker.write_text(socket.gethostname())
    distributed.barrier()
    seen = "sees" if marker.is_file() else "does not see"
    distributed.barrier()  # every rank has looked before rank 0 removes it
    if world.is_main:
        marker.unlink(missing_ok=True)
    every_rank_agrees({"view of the marker": f"{seen} {marker.name}"}, world, fix=SHARED_FOLDER, folder=folder)


def same_checkpoint(step: int | None, folder: Path, world: distributed.World) -> None:
    """A rank that resumes from another step than rank 0 (or starts fresh while rank 0 resumes) would
    train out of step: on several nodes it means the checkpoint folder is not one shared folder."""
    found = "no checkpoint" if step is None else f"a checkpoint at step {step}"
    every_rank_agrees({"checkpoint": found}, world, fix=SHARED_FOLDER, folder=folder)


def state_sha256(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def weights_in_sync(model: torch.nn.Module, world: distributed.World) -> bool | None:
    """At the end of training: do the ranks hold the same weights (None on one process)? Logged, not raised:
    the run's outputs are still written, and train_run.json records the answer."""
    if not world.is_distributed:
        return None
    in_sync = len(set(distributed.all_gather_objects(state_sha256(model)))) == 1
    if not in_sync:
        log.error("the ranks' weights differ at the end of training: DDP did not keep them in sync")
    return in_sync
