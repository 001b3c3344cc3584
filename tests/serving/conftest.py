"""Fixtures of the serving tests: one tiny trained and exported model for the whole package."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks import export, preprocess, train
from tests.helpers.folders import make_imagefolder
from tests.helpers.serving import PARAMS


@pytest.fixture(scope="package")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """images/, shards/, models/model.pt, models/model.onnx, reports/export.json: the pipeline's outputs."""
    root = tmp_path_factory.mktemp("serving")
    make_imagefolder(root / "images", classes=3, per_class=12)
    preprocess.run(PARAMS.preprocess, seed=PARAMS.seed, source=root / "images", out_dir=root / "shards")
    train.run(
        PARAMS.train, seed=PARAMS.seed, shard_dir=root / "shards", model_path=root / "models" / "model.pt",
        history_path=root / "h.json", plot_path=root / "h.png", runs_dir=root / "runs", provenance={},
    )  # fmt: skip
    export.run(
        PARAMS.export, seed=PARAMS.seed, model_path=root / "models" / "model.pt", shard_dir=root / "shards",
        onnx_path=root / "models" / "model.onnx", exports_dir=root / "models" / "exports",
        report_path=root / "reports" / "export.json", timings_path=root / "reports" / "export_timings.json",
    )  # fmt: skip
    return root
