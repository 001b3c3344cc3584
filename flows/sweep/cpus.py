"""The CPUs of trials that share this machine: each running trial holds its own, across studies too.

Trials sharing a machine run pinned to disjoint CPUs, so `train.threads: 0` counts a trial's own and the
experiment that `dvc exp apply` brings back holds only the searched values. Each CPU has a lock file,
runs/sweep/cpus/<cpu>.lock; a trial holds an flock on each CPU it runs on for its whole life, released when it
ends (by the kernel when its sweep dies, kill -9 included). A trial takes up to its share of the CPUs this
process may use (`share`: cores / sweep.parallel, at least one) from those no other trial holds, whatever its
study: a second study's sweep in the same project gets the CPUs the first left free, and where none is free
its trial waits for one. Where no CPU affinity can be set (macOS) there is nothing to claim: trials share the
CPUs and split them with train.threads (flows/sweep_flow.py).
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

FOLDER = "cpus"  # under runs/sweep/


def share(parallel: int) -> int | None:
    """How many CPUs each of `parallel` trials runs on; None where CPU affinity cannot be set."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return max(1, len(os.sched_getaffinity(0)) // parallel)


def _take(folder: Path, cpu: int) -> IO[str] | None:
    handle = open(folder / f"{cpu}.lock", "a")  # noqa: SIM115 - held open while the trial runs
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


@contextmanager
def claimed(runs: Path, want: int, log: Callable[[str], None], poll_s: float = 1.0) -> Iterator[list[int]]:
    """Up to `want` CPUs no other trial holds, held while the block runs; waits while every CPU is held."""
    folder = runs / "sweep" / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    held: dict[int, IO[str]] = {}
    told = False
    try:
        while not held:
            for cpu in sorted(os.sched_getaffinity(0)):
                handle = _take(folder, cpu) if len(held) < want else None
                if handle is not None:
                    held[cpu] = handle
            if not held:
                if not told:
                    log(f"waiting for a free CPU: every one is held by a running trial (locks in {folder})")
                    told = True
                time.sleep(poll_s)
        yield sorted(held)
    finally:
        for handle in held.values():
            handle.close()
