"""train, evaluate and export on tiny shards: same weights twice, parity gate, nothing half-written."""

from __future__ import annotations

import hashlib
from pathlib import Path

import onnx
import pytest

from tasks import evaluate, export, preprocess, train
from tasks.cli import StageError
from tasks.io import read_json
from tasks.params import Params
from tests.conftest import TINY

PARAMS = Params.model_validate(TINY | {"train": {**TINY["train"], "epochs": 2}})


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.conftest import make_imagefolder

    root = tmp_path_factory.mktemp("stages")
    make_imagefolder(root / "images", classes=3, per_class=24)
    preprocess.run(PARAMS.preprocess, seed=PARAMS.seed, source=root / "images", out_dir=root / "shards")
    return root / "shards"


def train_once(shards: Path, out: Path, **update: object) -> Path:
    params = PARAMS.train.model_copy(update=update)
    train.run(
        params, seed=PARAMS.seed, shard_dir=shards, model_path=out / "model.pt",
        history_path=out / "history.json", plot_path=out / "history.png", runs_dir=out / "runs",
        provenance={"params_sha256": "x"},
    )  # fmt: skip
    return out / "model.pt"


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def model(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_once(shards, tmp_path_factory.mktemp("model"))


def test_same_params_give_the_same_weights(shards: Path, model: Path, tmp_path: Path) -> None:
    assert md5(train_once(shards, tmp_path / "again")) == md5(model)
    assert md5(train_once(shards, tmp_path / "workers", num_workers=2)) == md5(model)
    assert md5(train_once(shards, tmp_path / "other", lr=0.02)) != md5(model)


def test_history_has_one_row_per_epoch(model: Path) -> None:
    history = read_json(model.parent / "history.json")
    assert [row["epoch"] for row in history] == [1, 2]
    assert (model.parent / "history.png").read_bytes()[:4] == b"\x89PNG"


def test_evaluate_writes_metrics_and_confusion(shards: Path, model: Path, tmp_path: Path) -> None:
    result = evaluate.run(
        PARAMS.evaluate, model_path=model, shard_dir=shards, metrics_path=tmp_path / "m.json",
        confusion_json=tmp_path / "c.json", confusion_png=tmp_path / "c.png",
    )  # fmt: skip
    metrics = read_json(tmp_path / "m.json")
    assert metrics["accuracy"] == result.accuracy and set(metrics["per_class"]) == {"class_0", "class_1", "class_2"}
    assert len(read_json(tmp_path / "c.json")) == metrics["num_samples"] == result.num_samples
    assert sum(c["support"] for c in metrics["per_class"].values()) == metrics["num_samples"]


def test_export_is_single_file_with_metadata_and_parity(shards: Path, model: Path, tmp_path: Path) -> None:
    onnx_path = tmp_path / "model.onnx"
    result = export.run(PARAMS.export, model_path=model, shard_dir=shards, onnx_path=onnx_path,
                        report_path=tmp_path / "export.json")  # fmt: skip
    assert result.agreement == 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export.json", "model.onnx"]
    meta = {p.key: p.value for p in onnx.load(str(onnx_path)).metadata_props}
    assert '"class_0"' in meta["class_names"] and meta["model_sha256"] == hashlib.sha256(model.read_bytes()).hexdigest()
    dims = onnx.load(str(onnx_path)).graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param and [d.dim_value for d in dims[1:]] == [3, 32, 32]


def test_export_gate_failure_leaves_no_model(shards: Path, model: Path, tmp_path: Path) -> None:
    strict = PARAMS.export.model_copy(update={"max_abs_diff": 1e-12})
    with pytest.raises(StageError, match="max_abs_diff .* > export.max_abs_diff 1e-12"):
        export.run(strict, model_path=model, shard_dir=shards, onnx_path=tmp_path / "model.onnx",
                   report_path=tmp_path / "export.json")  # fmt: skip
    assert list(tmp_path.iterdir()) == []
