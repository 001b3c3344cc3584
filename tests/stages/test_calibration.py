"""Calibrated confidence through the stages: train records its temperature in model.pt and train_run.json,
evaluate reports ECE and NLL with and without it and draws reliability.png, and export folds it into every format
(ONNX output = PyTorch logits / T) and its metadata."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks import evaluate
from tasks.core.calibration_error import calibration_report
from tasks.core.io import read_json
from tasks.images.shards import ShardSplit
from tasks.release import run_record
from tasks.release.inference import OnnxModel
from tasks.release.onnx_metadata import TEMPERATURE_KEY
from tasks.training.models import load_model_file, predict_logits
from tasks.training.serialize import load_torchscript
from tests.helpers.export import PARAMS, export_model

T = 2.5  # far from anything a fit would give: the tests see exactly the temperature they planted


@pytest.fixture(scope="module")
def tempered_model(export_model_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the trained model.pt whose calibration says T = 2.5."""
    out = tmp_path_factory.mktemp("tempered") / "model.pt"
    payload = torch.load(export_model_file, map_location="cpu", weights_only=True)
    payload["calibration"] = {**payload.get("calibration", {}), "temperature": T, "applied": True}
    torch.save(payload, out)
    shutil.copy(export_model_file.parent / "train_dynamics.json", out.parent / "train_dynamics.json")
    return out


def test_train_records_its_temperature(export_model_file: Path, export_shards: Path) -> None:
    payload = load_model_file(export_model_file)[2]
    fit = payload["calibration"]
    assert fit == read_json(export_model_file.parent / "train_run.json")["calibration"]
    assert fit["method"] == "temperature scaling on the validation split (NLL)" and fit["reason"]
    assert fit["val_images"] == len(ShardSplit.open(export_shards, "val"))  # the whole split
    if fit["applied"]:
        assert fit["temperature"] != 1.0 and fit["val_nll_after"] < fit["val_nll_before"]
    else:
        assert fit["temperature"] == 1.0


def test_export_divides_every_format_by_the_temperature(
    tempered_model: Path, export_shards: Path, tmp_path: Path
) -> None:
    export_model(export_shards, tempered_model, tmp_path)
    raw, spec, _ = load_model_file(tempered_model)
    images = ShardSplit.open(export_shards, "test").all_images()
    expected = predict_logits(raw, images, spec) / T
    served = OnnxModel.load(tmp_path / "models" / "model.onnx")
    assert served.metadata[TEMPERATURE_KEY] == "2.5" and float(served.metadata[TEMPERATURE_KEY]) == T
    np.testing.assert_allclose(served.logits(images), expected, atol=PARAMS.export.max_abs_diff)
    scripted, ts_meta = load_torchscript(tmp_path / "models" / "exports" / "model.torchscript.pt")
    assert ts_meta[TEMPERATURE_KEY] == "2.5"
    np.testing.assert_allclose(predict_logits(scripted, images, spec), expected, atol=1e-5)
    report = read_json(tmp_path / "reports" / "export.json")
    assert report["temperature"] == T and report["agreement"] == 1.0  # parity: PyTorch / T against ONNX
    assert report["max_abs_diff"] <= PARAMS.export.max_abs_diff
    int8 = report["onnx_int8"]
    if int8["kept"]:
        assert OnnxModel.load(tmp_path / "models" / "exports" / "model.int8.onnx").metadata[TEMPERATURE_KEY] == "2.5"
    # the drift reference is of the served (calibrated) probabilities: its top-1 deciles sit below the raw ones
    reference = json.loads(served.metadata["drift_reference"])
    assert reference == report["drift_reference"]


def test_evaluate_reports_calibration_and_draws_reliability(
    tempered_model: Path, export_shards: Path, tmp_path: Path
) -> None:
    evaluate.run(
        PARAMS.evaluate, model_path=tempered_model, shard_dir=export_shards, metrics_path=tmp_path / "metrics.json",
        confusion_json=tmp_path / "c.json", confusion_png=tmp_path / "c.png",
        dynamics_path=tempered_model.parent / "train_dynamics.json",
    )  # fmt: skip
    assert (tmp_path / "reliability.png").read_bytes()[:4] == b"\x89PNG"
    metrics = read_json(tmp_path / "metrics.json")
    calibration = metrics["calibration"]
    raw, spec, _ = load_model_file(tempered_model)
    test = ShardSplit.open(export_shards, "test")
    logits = predict_logits(raw, test.all_images(), spec)
    assert calibration == calibration_report(logits, test.labels, T)
    assert calibration["temperature"] == T and calibration["bins"] == 15
    assert calibration["nll_uncalibrated"] == pytest.approx(metrics["loss"], abs=1e-5)
    assert calibration["nll"] != calibration["nll_uncalibrated"]
    mlflow = run_record.test_metrics(metrics)
    assert mlflow["temperature"] == T and mlflow["test_ece"] == calibration["ece"]
    assert mlflow["test_ece_uncalibrated"] == calibration["ece_uncalibrated"]
