"""Stage environment: this machine and venv -> reports/environment/<stage>.json, one per stage.

What each stage resolves outside params.yaml: library versions, the CPU features that choose kernels,
device, precision, memory format and threads, resolved by the same functions the stages use. Each file
is a dependency of its stage in dvc.yaml, and this stage is `always_changed`: DVC runs it on every
`dvc repro` (about 3 s), and a stage reruns only when its own file's bytes changed. A clone on a CPU
with native bf16 therefore retrains (its train file says bf16), one with the same machine does not,
and `make check-reproduced` names what differed from the committed run.

Whether the gate is enforced is not part of any record: check_regression is `always_changed` and
decides it when it runs (not under `dvc exp run`, which records the verdict only).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from tasks.core.cli import stage_main
from tasks.core.environment import (
    LIBRARIES,
    cpu_flags,
    library_versions,
    machine,
    off_pin,
    pinned,
    usable_cores,
)
from tasks.core.io import write_json
from tasks.core.params import Params
from tasks.training import distributed
from tasks.training.hooks import ALLOW as ALLOW_HOOKS_ENV
from tasks.training.hooks import ENV as HOOKS_ENV
from tasks.training.precision import resolve_precision
from tasks.training.runtime import cpu_threads

log = logging.getLogger(__name__)


def cpu(flags: list[str]) -> dict[str, Any]:
    """The CPU as kernels see it: torch's dispatch level and the flags oneDNN and onnxruntime test."""
    return {"torch_capability": torch.backends.cpu.get_cpu_capability(), "flags": flags}


def resolve(params: Params) -> dict[str, dict[str, Any]]:
    """Each stage's environment, as that stage resolves it on this machine."""
    flags = cpu_flags()
    world = distributed.world_from_env()
    t = params.train
    try:
        device = distributed.resolve_device(t.device, world)
    except RuntimeError as exc:  # train.device cuda on a machine without one: the train stage says so
        device, train = None, {"device": f"unavailable: {exc}"}
    if device is not None:
        precision = resolve_precision(t.precision, device, t.memory_format)
        train = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "precision": precision.name,
            "memory_format": precision.memory_format,
            "threads": cpu_threads(t.threads, t.nproc_per_node),
            "processes_per_node": t.nproc_per_node,
            "nodes": t.nnodes,
        }
        if device.type == "cuda":
            train.update(cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    hooks = os.environ.get(HOOKS_ENV)
    if hooks:  # a test's run: part of the key, so DVC's run cache never hands its model to a production run
        train["test_hooks"] = {"module": hooks, "allowed": os.environ.get(ALLOW_HOOKS_ENV) == "1"}
    stages: dict[str, dict[str, Any]] = {
        "generate": {},
        "preprocess": {},
        "train": {**train, "cpu": cpu(flags)},
        "evaluate": {"device": "cpu", "precision": "fp32", "threads": torch.get_num_threads(), "cpu": cpu(flags)},
        "export": {"device": "cpu", "threads": params.export.threads or usable_cores(), "cpu": cpu(flags)},
        "check_regression": {
            "device": "cpu",
            "threads": "onnxruntime's default",
            "cores": usable_cores(),
            "cpu_flags": flags,
        },  # fmt: skip
    }
    return {name: {"stage": name, **machine(), "libraries": library_versions(LIBRARIES[name]), **env}
            for name, env in stages.items()}  # fmt: skip


def run(params: Params, out_dir: Path) -> dict[str, dict[str, Any]]:
    resolved = resolve(params)
    versions = {name: v for record in resolved.values() for name, v in record["libraries"].items()}
    for name, why in off_pin(versions, pinned()).items():
        log.warning("%s %s: this venv is not the tested one; the stages that use it record the difference", name, why)
    for name, record in resolved.items():
        write_json(out_dir / f"{name}.json", record)
    t = resolved["train"]
    log.info("train: %s, %s, %s thread(s); torch %s", t["device"], t.get("precision", "-"), t.get("threads", "-"),
             t["libraries"]["torch"])  # fmt: skip
    return resolved


def _main(p: Params) -> None:
    run(p, p.paths.environment)


def main() -> None:
    stage_main("environment", _main)


if __name__ == "__main__":
    main()
