"""Fixtures of the serving tests: one tiny trained and exported model for the whole package."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.folders import make_imagefolder
from tests.helpers.serving import trained_and_exported


@pytest.fixture(scope="package")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """images/, shards/, models/model.pt, models/model.onnx, reports/export.json: the pipeline's outputs."""
    root = tmp_path_factory.mktemp("serving")
    make_imagefolder(root / "images", classes=3, per_class=12)
    return trained_and_exported(root)
