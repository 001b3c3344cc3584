"""The run manifest: which code, params, data, pipeline state and tool versions a flow run used.

repo (git HEAD, dvc.lock, params.yaml, the shard manifest, model files) + the Prefect run -> one dict,
written to reports/run_manifest.json (not a DVC output: it names a run, so it differs every run).
"""

from __future__ import annotations

import importlib.metadata
import platform
from pathlib import Path
from typing import Any

from tasks.core.git import changed_files, head_commit
from tasks.core.io import read_json, sha256_file
from tasks.core.params import Params, section_hash
from tasks.images.shards import MANIFEST

VERSIONED = ("torch", "torchvision", "prefect", "dvc", "onnx", "onnxruntime", "numpy")
MAX_LISTED_CHANGES = 20


def _sha256(path: Path) -> str | None:
    return sha256_file(path) if path.is_file() else None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_state(repo: Path) -> dict[str, Any]:
    """HEAD and the tracked files that differ from it (a run that changed dvc.lock lists it)."""
    changed = changed_files(repo)
    return {
        "commit": head_commit(repo),
        "changed_files": changed[:MAX_LISTED_CHANGES],
        "dirty": bool(changed),
    }


def build_manifest(
    repo: Path,
    params: Params,
    *,
    flow_run: dict[str, str | None],
    stages: dict[str, str],
    status: str,
    why: dict[str, list[str]] | None = None,
) -> dict[str, Any]:
    """Everything needed to say what produced this run's outputs; paths relative to `repo`. `why`: each
    stage's reasons from DVC's status (flows/explain.py); `metrics` and `params` let a later run compare."""
    paths = params.paths
    metrics = repo / paths.metrics
    return {
        "status": status,
        "stages": stages,
        "why": why or {},
        "metrics": read_json(metrics) if metrics.is_file() else None,
        "params": params.model_dump(mode="json"),
        "prefect": flow_run,
        "git": git_state(repo),
        "dvc_lock_sha256": _sha256(repo / "dvc.lock"),
        "params_sha256": section_hash(params),
        "data_manifest_sha256": _sha256(repo / paths.shards / MANIFEST),
        "model_sha256": _sha256(repo / paths.model),
        "onnx_sha256": _sha256(repo / paths.onnx),
        "versions": {"python": platform.python_version(), **{name: _version(name) for name in VERSIONED}},
    }
