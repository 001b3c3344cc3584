"""Fixtures of the serving tests: one tiny trained and exported model for the whole package, built once per
test run: under pytest-xdist its workers share it (the first to ask builds it, the others wait on a lock)."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

import pytest

from tests.helpers.folders import make_imagefolder
from tests.helpers.serving import trained_and_exported


@pytest.fixture(scope="package")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """images/, shards/, models/model.pt, models/model.onnx, reports/export.json: the pipeline's outputs."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return build(tmp_path_factory.mktemp("serving"))
    root = tmp_path_factory.getbasetemp().parent / "serving-project"  # this run's folder, shared by its workers
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / "serving-project.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "built").is_file():
            shutil.rmtree(root, ignore_errors=True)  # a worker that failed building it left a part
            build(root)
            (root / "built").touch()
    return root


def build(root: Path) -> Path:
    make_imagefolder(root / "images", classes=3, per_class=12)
    return trained_and_exported(root)
