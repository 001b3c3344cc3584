"""DDP plumbing: the world from torchrun's environment, the device, the process group, and reductions.

`python -m tasks.train` with train.nproc_per_node > 1 runs itself again under
`torchrun --standalone --nproc_per_node N` (gloo on CPU, nccl on CUDA). With train.nnodes > 1 it
runs under torchrun's multi-node flags instead (c10d rendezvous at train.rdzv_endpoint): the head
node's process, the one `dvc repro train` started, hosts the rendezvous; every other node joins with
`python -m tasks.train --join` (`make train-join`). The head's ranks come first, so global rank 0,
the only one that writes, is on the head and DVC there records what it wrote. A torchrun the user
starts by hand sets RANK/WORLD_SIZE, so nothing relaunches.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


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


HEAD_ENV = "IMAGEPIPE_TRAIN_HEAD"  # "1" in the ranks of the head node (set by its launcher, passed on by torchrun)
RDZV_ID = "imagepipe-train"


def nodes() -> int:
    """How many nodes torchrun's rendezvous joined (1 without torchrun)."""
    return int(os.environ.get("GROUP_WORLD_SIZE", "1"))


def needs_launch(nproc_per_node: int, nnodes: int = 1) -> bool:
    """True in the user's own process when more than one is asked for and torchrun has not started us."""
    return (nproc_per_node > 1 or nnodes > 1) and "RANK" not in os.environ


def torchrun_command(
    nproc_per_node: int, module: str, *, nnodes: int = 1, endpoint: str = "", head: bool = True, timeout_s: int = 600
) -> list[str]:
    """torchrun for this node: standalone on one node; else the c10d rendezvous at `endpoint`, which the
    head hosts (is_host) and the others join. No restarts: a lost node ends the job, a rerun resumes it."""
    command = [sys.executable, "-m", "torch.distributed.run"]
    if nnodes == 1:
        command += ["--standalone"]
    else:
        conf = f"is_host={int(head)},join_timeout={timeout_s},read_timeout={timeout_s}"
        command += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                    f"--rdzv-id={RDZV_ID}", f"--rdzv-conf={conf}", "--max-restarts=0"]  # fmt: skip
    return [*command, f"--nproc-per-node={nproc_per_node}", "-m", module]


def launch(command: list[str], *, head: bool = True, timeout_s: int = 600) -> int:
    """Run a torchrun command with this node's role in its environment; returns torchrun's exit status."""
    env = {key: value for key, value in os.environ.items() if key != HEAD_ENV}
    env["IMAGEPIPE_RDZV_TIMEOUT_S"] = str(timeout_s)
    if head:
        env[HEAD_ENV] = "1"
    return subprocess.call(command, env=env)


def resolve_device(requested: str, world: World) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device is cuda but torch sees no CUDA device; use auto or cpu")
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", world.local_rank % torch.cuda.device_count())


def init(world: World, device: torch.device) -> World:
    """Join the process group; returns this process's place in it (on several nodes, head ranks first)."""
    if not world.is_distributed or dist.is_initialized():
        return world
    backend = "nccl" if device.type == "cuda" else "gloo"
    options: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        options["device_id"] = device
    if nodes() > 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # the agents' store to meet in
        world, store = _head_first(world)
        options.update(store=store, rank=world.rank, world_size=world.size)
    dist.init_process_group(backend, **options)
    return world


def _head_first(world: World) -> tuple[World, dist.Store]:
    """Renumber the ranks so that the head node's come first, in their old order, then the others'.

    c10d's rendezvous numbers nodes by address and pid, so global rank 0 can land on any node; the
    outputs must be written where `dvc repro train` runs. Uses the store of torchrun's agents
    (MASTER_ADDR:MASTER_PORT) before the process group exists."""
    env = os.environ
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=int(env.get("IMAGEPIPE_RDZV_TIMEOUT_S", "600"))))  # fmt: skip
    prefix = f"imagepipe/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store.set(f"{prefix}/head/{world.rank}", env.get(HEAD_ENV, "0"))
    keys = [f"{prefix}/head/{rank}" for rank in range(world.size)]
    store.wait(keys)
    heads = [store.get(key) == b"1" for key in keys]  # none: a torchrun started by hand keeps its numbering
    order = sorted(range(world.size), key=lambda rank: (not heads[rank], rank))
    rank = order.index(world.rank)
    env["RANK"] = str(rank)
    return World(rank, world.size, world.local_rank, world.local_size), dist.PrefixStore(f"{prefix}/pg", store)


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
    """Element-wise sum of a tensor over ranks, as a new tensor (the input is left as it is)."""
    if not _active():
        return counts
    tensor = counts.to(_reduce_device(), copy=True)
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


def wrap(
    module: torch.nn.Module, world: World, device: torch.device, *, compile: bool = False
) -> tuple[torch.nn.Module, torch.nn.parallel.DistributedDataParallel | None]:
    """What the step calls for `module` (already on `device`): DDP around it on several processes, and
    torch.compile if asked; the DDP wrapper too, for its no_sync(). Checkpoints hold `module`'s own keys."""
    ddp = None
    if world.is_distributed:
        ddp = torch.nn.parallel.DistributedDataParallel(module, device_ids=[device] if device.type == "cuda" else None)
    wrapped: torch.nn.Module = ddp if ddp is not None else module
    return (torch.compile(wrapped) if compile else wrapped), ddp


def lost_peer(exc: RuntimeError) -> bool:
    """A collective that failed because another rank's process is gone, not a bug in this one (gloo says
    "Connection reset by peer" as a RuntimeError, nccl raises a DistError)."""
    return isinstance(exc, dist.DistError) or "/gloo/transport/" in str(exc)


def lost_peer_message(exc: RuntimeError, checkpoints: Path) -> str:
    said = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
    rerun = "on the head `dvc repro train`, on the others `make train-join`" if nodes() > 1 else "`dvc repro train`"
    return (f"lost contact with another rank ({said}); the job stops on every rank. Rerun it ({rerun}): it resumes "
            f"from the last checkpoint every rank reached, in {checkpoints}")  # fmt: skip


def relaunch(module: str, *, nproc_per_node: int, nnodes: int, endpoint: str, timeout_s: int, join: bool) -> bool:
    """In the user's own process, when more than one process is asked for: rerun `module` under torchrun
    (this node's part of the job) and return True once it has finished; False when this process should train.

    Raises RelaunchError for --join where there is nothing to join, and when torchrun fails."""
    if join and nnodes == 1:
        raise RelaunchError("--join: train.nnodes is 1 in params.yaml, so there is no multi-node job to join")
    if not needs_launch(nproc_per_node, nnodes):
        if join:
            raise RelaunchError("--join is for the node's own launcher, not for a process torchrun started")
        return False
    if nnodes > 1:
        log.info("%s node of %d, %d process(es) each, rendezvous at %s (waiting up to %d s for the others)",
                 "joining as another" if join else "head", nnodes, nproc_per_node, endpoint, timeout_s)  # fmt: skip
    command = torchrun_command(nproc_per_node, module, nnodes=nnodes, head=not join, endpoint=endpoint,
                               timeout_s=timeout_s)  # fmt: skip
    status = launch(command, head=not join, timeout_s=timeout_s)
    if status:
        where = "" if nnodes == 1 else f" on the {'joining' if join else 'head'} node"
        raise RelaunchError(f"torchrun exited with status {status}{where}; the ranks' messages are above")
    return True


class RelaunchError(RuntimeError):
    """The launch could not start or its ranks failed: the message says which, for the user."""
