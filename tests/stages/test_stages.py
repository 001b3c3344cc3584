"""evaluate on a tiny trained model (train: tests/stages/test_train.py; export: tests/stages/test_export.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tasks import evaluate, preprocess, train
from tasks.core.io import read_json
from tasks.core.params import Params
from tests.helpers.project import TINY

PARAMS = Params.model_validate(TINY | {"train": {**TINY["train"], "epochs": 2}})


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.helpers.folders import make_imagefolder

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


# The train stage's own tests (determinism, history, resume, faults): tests/stages/test_train.py, tests/training/.


def test_evaluate_writes_metrics_and_confusion(shards: Path, model: Path, tmp_path: Path) -> None:
    result = evaluate.run(
        PARAMS.evaluate, model_path=model, shard_dir=shards, metrics_path=tmp_path / "m.json",
        confusion_json=tmp_path / "c.json", confusion_png=tmp_path / "c.png",
    )  # fmt: skip
    metrics = read_json(tmp_path / "m.json")
    assert metrics["accuracy"] == result.accuracy and set(metrics["per_class"]) == {"class_0", "class_1", "class_2"}
    assert len(read_json(tmp_path / "c.json")) == metrics["num_samples"] == result.num_samples
    assert sum(c["support"] for c in metrics["per_class"].values()) == metrics["num_samples"]


# The export stage's tests are in tests/stages/test_export.py (and the gate's in tests/stages/test_check_regression.py).
