"""The promoted baseline (baseline/: metrics.json, model.json, model.onnx) and the hash checks made
before a model file is used; shared by check_regression, promote, serving and the regression flow.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tasks.cli import StageError
from tasks.inference import ModelIntegrityError, ModelMetadataError, OnnxModel
from tasks.io import read_json

BASELINE_ONNX = "model.onnx"  # the promoted model itself
BASELINE_METRICS = "metrics.json"  # the promoted model's metrics (make promote)
BASELINE_MODEL = "model.json"  # the promoted model's hashes


def recorded_onnx_sha256(export_report: Path) -> str:
    """The hash the export stage recorded for the ONNX file it proved equal to PyTorch."""
    if not export_report.is_file():
        raise StageError(f"{export_report}: missing; run the export stage first (dvc repro export)")
    digest = read_json(export_report).get("onnx_sha256")
    if not isinstance(digest, str) or len(digest) != 64:
        raise StageError(f"{export_report}: no valid onnx_sha256 (got {digest!r})")
    return digest


def load_verified_model(onnx_path: Path, export_report: Path) -> OnnxModel:
    """The ONNX model, refused before use when its bytes are not the ones export recorded."""
    try:
        return OnnxModel.load(onnx_path, expected_sha256=recorded_onnx_sha256(export_report))
    except (ModelIntegrityError, ModelMetadataError, FileNotFoundError) as exc:
        raise StageError(str(exc)) from None


def load_baseline(baseline_dir: Path) -> dict[str, Any] | None:
    """baseline/metrics.json, or None when nothing was promoted yet.

    A baseline that DVC tracks (metrics.json.dvc) but whose file is absent is an error, not
    "no baseline": a CI job that forgot `dvc pull` must not pass the gate by accident.
    """
    path = baseline_dir / BASELINE_METRICS
    tracked = path.with_name(path.name + ".dvc")
    if not path.is_file():
        if tracked.is_file():
            raise StageError(
                f"{path}: the baseline is tracked by DVC ({tracked}) but missing; run `dvc pull {tracked}`"
            )
        return None
    try:
        baseline = read_json(path)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StageError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(baseline, dict):
        raise StageError(f"{path}: expected a JSON object of metrics, got {type(baseline).__name__}")
    return baseline
