"""Which ONNX file is production, and its recorded hash: baseline/ (make promote) else the export stage's.

Params `paths` -> a hash-verified `OnnxModel` plus a short description of where it came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tasks.baseline import BASELINE_MODEL, BASELINE_ONNX, recorded_onnx_sha256
from tasks.cli import StageError
from tasks.inference import OnnxModel
from tasks.io import read_json
from tasks.params import Paths


class ModelSourceError(RuntimeError):
    """No production model, or no recorded hash to check it against."""


@dataclass(frozen=True)
class ModelSource:
    path: Path
    expected_sha256: str
    source: str  # "baseline" (promoted) or "export" (the last dvc repro)


def production_model(paths: Paths) -> ModelSource:
    """The promoted baseline's ONNX when there is one, else the exported model; never an unverified file."""
    onnx, record = paths.baseline / BASELINE_ONNX, paths.baseline / BASELINE_MODEL
    if onnx.is_file():
        if not record.is_file():
            raise ModelSourceError(f"{onnx}: present but {record} (its recorded sha256) is missing; run make promote")
        digest = read_json(record).get("onnx_sha256")
        if not isinstance(digest, str) or len(digest) != 64:
            raise ModelSourceError(f"{record}: no valid onnx_sha256 (got {digest!r})")
        return ModelSource(onnx, digest, "baseline")
    if not paths.onnx.is_file():
        raise ModelSourceError(f"no model to serve: neither {onnx} (make promote) nor {paths.onnx} (dvc repro)")
    try:
        digest = recorded_onnx_sha256(paths.reports / "export.json")
    except StageError as exc:
        raise ModelSourceError(str(exc)) from None
    return ModelSource(paths.onnx, digest, "export")


def load_production_model(paths: Paths, threads: int) -> tuple[OnnxModel, ModelSource]:
    source = production_model(paths)
    return OnnxModel.load(source.path, expected_sha256=source.expected_sha256, threads=threads), source
