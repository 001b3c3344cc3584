"""What a training run is: the identity a checkpoint must match to be resumed or taken as finished.

It covers the params that shape the weights, the data, the start weights, and two things read from what
runs rather than from a list someone keeps: the code (every project file the train process loaded, by
md5, as tasks/core/provenance.py finds them) and the environment (the train stage's own record,
reports/environment/train.json: libraries, CPU flags, threads, precision). Two machines whose bf16
kernels differ (AMX or not) therefore never share a run, even through a shared `paths.checkpoints`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tasks.core import provenance
from tasks.core.errors import StageError
from tasks.core.io import read_json
from tasks.core.nested import flatten
from tasks.core.params import TrainParams

# Train params left out of the run identity, so changing them (say, auto_batch after an OOM, or more
# workers) still resumes the interrupted run. None changes the weights, except `compile`, whose fused
# kernels round differently: a checkpoint loads with or without it, by design.
OPERATIONAL = frozenset(
    {"num_workers", "threads", "checkpoint_every_steps", "resume", "histogram_every_steps", "auto_batch"}
    | {"nonfinite", "max_nonfinite", "compile", "keep_checkpoint_runs", "rdzv_endpoint", "rdzv_timeout_s"}
)


@dataclass(frozen=True)
class RunIdentity:
    params_sha256: str  # the train params that shape the weights, the seed, init weights, device, precision
    data_sha256: str  # the shard manifest
    code_sha256: str = ""  # the train stage's code, as the process loaded it
    environment_sha256: str = ""  # the stage's environment record: libraries, CPU flags, threads, precision
    parts: dict[str, Any] = field(default_factory=dict, compare=False)  # what each hash covers, for the why

    @property
    def name(self) -> str:
        key = f"{self.params_sha256}:{self.data_sha256}"
        if self.code_sha256 or self.environment_sha256:
            key += f":{self.code_sha256}:{self.environment_sha256}"
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def hashes(self) -> dict[str, str]:
        return {"params": self.params_sha256, "data": self.data_sha256, "code": self.code_sha256,
                "environment": self.environment_sha256}  # fmt: skip


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def run_identity(
    params: TrainParams,
    *,
    seed: int,
    data_sha256: str,
    init_sha256: str | None,
    device_type: str,
    precision: str = "fp32",
    memory_format: str = "contiguous",
    code: dict[str, str] | None = None,
    environment: dict[str, Any] | None = None,
) -> RunIdentity:
    """What the weights depend on: the params, data and start weights; the resolved precision and memory
    format (auto resolves to bf16 or channels_last on one CPU, fp32 or contiguous on another); the train
    stage's code (`code`: file -> md5) and its environment record (`environment`). A run
    never resumes, or takes as finished, a checkpoint that any of these differ from."""
    shaping = params.model_dump(mode="json", exclude=set(OPERATIONAL))
    described = {"train": shaping, "seed": seed, "init": init_sha256, "device": device_type, "precision": precision,
                 "memory_format": memory_format, "torch": torch.__version__}  # fmt: skip
    code = code if code is not None else {}
    environment = environment if environment is not None else {}
    return RunIdentity(
        _sha256_json(described), data_sha256, provenance.code_sha256(code) if code else "",
        _sha256_json(environment) if environment else "",
        parts={"params": described, "data": data_sha256, "code": code, "environment": environment},
    )  # fmt: skip


def identity_differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """`code tasks/training/augment.py`, `environment libraries.torch`, `params train.lr`, `data`: what
    differs between two identities' parts, by name."""
    flat_a, flat_b = flatten(theirs), flatten(mine)
    keys = sorted(k for k in set(flat_a) | set(flat_b) if flat_a.get(k) != flat_b.get(k))
    return [key.replace(".", " ", 1) if key.startswith(("code.", "environment.", "params.")) else key
            for key in keys]  # fmt: skip


def train_code(root: Path | None = None) -> dict[str, str]:
    """The code this process runs, as the train stage's deps in dvc.yaml cover it: file -> md5. In a stage
    run that is every project file loaded (tasks/core/cli.py refuses any other); in a test process that has
    loaded more, the rest is left out."""
    try:
        return provenance.stage_code("train", root or provenance.project_root())
    except (OSError, provenance.ProvenanceError) as exc:
        raise StageError(f"the train stage's code cannot be hashed for the run identity: {exc}") from None


def stage_environment(record: Path) -> dict[str, Any]:
    """The train stage's environment record (written by the environment stage), or {} where there is none
    (train.run called outside the pipeline, as tests do)."""
    if not record.is_file():
        return {}
    try:
        return read_json(record)
    except ValueError as exc:
        raise StageError(f"{record}: not the environment stage's JSON ({exc}); run `dvc repro environment`") from None
