"""Every rank must agree (tasks/training/consistency.py): two real gloo processes, one helper, three checks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tasks.core.errors import StageError
from tasks.training import consistency
from tasks.training.distributed import World
from tests.helpers.prefect import free_port

pytestmark = pytest.mark.fast  # unit-level: make test-fast


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    world = World(rank=rank, size=2, local_rank=rank, local_size=2)
    said = []
    for name, check in (
        ("same", lambda: consistency.every_rank_agrees({"seed": "1", "params_sha256": "a" * 64}, world, fix="fix it")),
        ("params", lambda: consistency.same_inputs({"params_sha256": ("a" if rank == 0 else "b") * 64}, world)),
        ("checkpoint", lambda: consistency.same_checkpoint(None if rank else 40, Path(out), world)),
    ):
        try:
            check()
            said.append(f"{name}: agreed")
        except StageError as exc:
            said.append(f"{name}: {exc}")
    torch.manual_seed(rank)  # other weights on each rank
    said.append(f"in sync: {consistency.weights_in_sync(torch.nn.Linear(2, 2), world)}")
    Path(out, f"rank{rank}.txt").write_text("\n".join(said))
    dist.destroy_process_group()


def test_every_rank_agrees_names_the_odd_rank_on_every_rank(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):  # every rank raises, so no rank waits in a collective the other never reaches
        lines = (tmp_path / f"rank{rank}.txt").read_text().splitlines()
        assert lines[0] == "same: agreed"
        assert lines[1].startswith("params: rank 1 (") and "has other params_sha256 than rank 0 (" in lines[1]
        assert "params_sha256 bbbbbbbbbbbb vs aaaaaaaaaaaa" in lines[1]  # a sha256 is cut to 12 characters
        assert lines[1].endswith("`git checkout <commit> && dvc pull` there")
        assert f"{tmp_path}" in lines[2] and "checkpoint no checkpoint vs a checkpoint at step 40" in lines[2]
        assert "must be one folder that every node sees" in lines[2]
        assert lines[3] == "in sync: False"


def test_one_process_agrees_without_a_collective(tmp_path: Path) -> None:
    consistency.every_rank_agrees({"x": 1}, World(), fix="")
    consistency.checkpoints_shared(tmp_path, World())
    assert consistency.weights_in_sync(torch.nn.Linear(2, 2), World()) is None
