"""DDP plumbing: the world from torchrun's environment, the device, the process group, and reductions.

`python -m tasks.train` with train.nproc_per_node > 1 runs itself again under
`torchrun --standalone --nproc_per_node N` (gloo on CPU, nccl on CUDA). A multi-node job is started
by the user's own torchrun with rendezvous flags; it sets RANK/WORLD_SIZE, so nothing relaunches.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.size > 1


def world_from_env() -> World:
    env = os.environ
    return World(
        rank=int(env.get("RANK", 0)),
        size=int(env.get("WORLD_SIZE", 1)),
        local_rank=int(env.get("LOCAL_RANK", 0)),
        local_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
    )


def needs_launch(nproc_per_node: int) -> bool:
    """True in the user's own process when more than one is asked for and torchrun has not started us."""
    return nproc_per_node > 1 and "RANK" not in os.environ


def launch(nproc_per_node: int, module: str) -> int:
    """Run `python -m module` under torchrun on this machine; returns torchrun's exit status."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc_per_node={nproc_per_node}", "-m", module]
    return subprocess.call(command)


def resolve_device(requested: str, world: World) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device is cuda but torch sees no CUDA device; use auto or cpu")
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", world.local_rank % torch.cuda.device_count())


def init(world: World, device: torch.device) -> None:
    if not world.is_distributed or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _active() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _reduce_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce_sum(values: list[float]) -> list[float]:
    """Element-wise sum over ranks (float64); the input itself on one process."""
    if not _active():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=_reduce_device())
    dist.all_reduce(tensor)
    return tensor.cpu().tolist()


def all_reduce_counts(counts: torch.Tensor) -> torch.Tensor:
    """Element-wise sum of an integer tensor over ranks."""
    if not _active():
        return counts
    tensor = counts.to(_reduce_device())
    dist.all_reduce(tensor)
    return tensor.cpu()


def all_true(flag: bool) -> bool:
    """True only when every rank says True: ranks must take the same branch or the collectives hang."""
    return all_reduce_sum([0.0 if flag else 1.0])[0] == 0.0


def barrier() -> None:
    """Return once every rank has got here; nothing to wait for in one process."""
    if _active():
        dist.barrier()


def broadcast_buffers(module: torch.nn.Module) -> None:
    """Rank 0's buffers (BatchNorm running statistics) everywhere. DDP copies them only at the start of
    each forward, so after the last step every rank holds its own; validation and the saved model use rank 0's."""
    if _active():
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)


def all_gather_objects(obj: Any) -> list[Any]:
    if not _active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
