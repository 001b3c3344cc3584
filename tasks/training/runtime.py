"""The training process's runtime: `seed_everything` (two runs with the same params draw the same
numbers), the thread count, and a warning when other jobs already keep the cores busy.
"""

from __future__ import annotations

import logging
import os
import random

import numpy as np
import torch

from tasks.core.environment import cpu_threads, usable_cores

__all__ = ["cpu_threads", "seed_everything", "usable_cores", "warn_if_cores_busy"]

log = logging.getLogger(__name__)


def seed_everything(seed: int, threads: int, device: torch.device) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS determinism needs it before init
        torch.backends.cudnn.benchmark = False
    # Some CUDA kernels (adaptive pooling backward) have no deterministic version: warn there, don't fail.
    torch.use_deterministic_algorithms(True, warn_only=device.type == "cuda")
    torch.set_num_threads(threads)


def warn_if_cores_busy(threads: int, processes_per_node: int = 1) -> float:
    """Warn when the 1-minute load average says other jobs already keep the cores busy; returns it.

    Threads that outnumber the free cores wait for each other at every parallel region: two trainings
    sharing 2 cores ran 2.4x slower each with the stages' GOMP_SPINCOUNT, up to 7x with libgomp's
    default spin (bench/bench_shared_cores.py)."""
    cores = usable_cores()
    load = os.getloadavg()[0]
    if load >= cores - 0.5:
        log.warning(
            "load average %.1f on %d cores: other jobs are using the CPUs, and %d process(es) x %d thread(s) "
            "will compete with them (two trainings on 2 cores ran about 2.4x slower each). Run one heavy job "
            "at a time, or give each fewer threads (train.threads)",
            load, cores, processes_per_node, threads,
        )  # fmt: skip
    return load
