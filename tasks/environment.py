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
from typing import Any

from tasks.core.cli import stage_main
from tasks.core.environment import (
    ALLOW_HOOKS_ENV,
    HOOKS_ENV,
    LIBRARIES,
    cpu_capability,
    cpu_features,
    cpu_flags,
    cpu_memory_format,
    cpu_precision,
    cpu_threads,
    library_versions,
    machine,
    may_have_cuda,
    native_bf16,
    off_pin,
    pinned,
    usable_cores,
)
from tasks.core.io import write_json
from tasks.core.params import Params, Paths, TrainParams

log = logging.getLogger(__name__)


def _train_without_torch(t: TrainParams, features: set[str], capability: str) -> dict[str, Any]:
    """What the train stage resolves on a CPU-only machine, by the rules it applies to torch's answers."""
    bf16 = native_bf16(features)
    precision = cpu_precision(t.precision, bf16)
    return {"device": "cpu", "precision": precision,
            "memory_format": cpu_memory_format(t.memory_format, precision, bf16, capability)}  # fmt: skip


def _train_with_torch(t: TrainParams) -> tuple[dict[str, Any], str]:
    """A GPU may be there (or the CPU rules do not apply): torch resolves it, as the train stage will."""
    import torch  # 2 s: only where the answer needs it

    from tasks.training import distributed
    from tasks.training.precision import resolve_precision

    capability = torch.backends.cpu.get_cpu_capability()
    try:
        device = distributed.resolve_device(t.device, distributed.world_from_env())
    except RuntimeError as exc:  # train.device cuda on a machine without one: the train stage says so
        return {"device": f"unavailable: {exc}"}, capability
    precision = resolve_precision(t.precision, device, t.memory_format)
    train = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
             "precision": precision.name, "memory_format": precision.memory_format}  # fmt: skip
    if device.type == "cuda":
        train.update(cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    return train, capability


def resolve(params: Params) -> dict[str, dict[str, Any]]:
    """Each stage's environment, as that stage resolves it on this machine. Without a GPU in sight and on an
    x86 CPU this imports no torch (a no-op `dvc repro` runs this stage every time)."""
    features, flags = cpu_features(), cpu_flags()
    t = params.train
    capability = cpu_capability(features)
    if capability is None or t.device == "cuda" or (t.device == "auto" and may_have_cuda()):
        train, capability = _train_with_torch(t)
    else:
        train = _train_without_torch(t, features, capability)
    if not train["device"].startswith("unavailable"):
        train.update(threads=cpu_threads(t.threads, t.nproc_per_node), processes_per_node=t.nproc_per_node,
                     nodes=t.nnodes)  # fmt: skip
    hooks = os.environ.get(HOOKS_ENV)
    if hooks:  # a test's run: part of the key, so DVC's run cache never hands its model to a production run
        train["test_hooks"] = {"module": hooks, "allowed": os.environ.get(ALLOW_HOOKS_ENV) == "1"}
    cpu = {"torch_capability": capability, "flags": flags}  # torch's dispatch level; the flags oneDNN and ORT test
    torch_threads = {"threads": "torch's default", "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                     "cores": usable_cores()}  # what torch's default intra-op thread count follows  # fmt: skip
    stages: dict[str, dict[str, Any]] = {
        "generate": {},
        "preprocess": {},
        "train": {**train, "cpu": cpu},
        "evaluate": {"device": "cpu", "precision": "fp32", **torch_threads, "cpu": cpu},
        "export": {"device": "cpu", "threads": params.export.threads or usable_cores(), "cpu": cpu},
        "check_regression": {
            "device": "cpu",
            "threads": "onnxruntime's default",
            "cores": usable_cores(),
            "cpu_flags": flags,
        },  # fmt: skip
    }
    return {name: {"stage": name, **machine(), "libraries": library_versions(LIBRARIES[name]), **env}
            for name, env in stages.items()}  # fmt: skip


def run(params: Params, paths: Paths) -> dict[str, dict[str, Any]]:
    """Write each stage's record where `paths` puts it (`Paths.environment_record`); return the records."""
    resolved = resolve(params)
    versions = {name: v for record in resolved.values() for name, v in record["libraries"].items()}
    for name, why in off_pin(versions, pinned()).items():
        log.warning("%s %s: this venv is not the tested one; the stages that use it record the difference", name, why)
    for name, record in resolved.items():
        write_json(paths.environment_record(name), record)
    t = resolved["train"]
    log.info("train: %s, %s, %s thread(s); torch %s", t["device"], t.get("precision", "-"), t.get("threads", "-"),
             t["libraries"]["torch"])  # fmt: skip
    return resolved


def _main(p: Params) -> None:
    run(p, p.paths)


def main() -> None:
    stage_main("environment", _main)


if __name__ == "__main__":
    main()
