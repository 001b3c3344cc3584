"""Shared fixtures. Plain helpers live in tests/helpers/ (folders, project, training, export, prefect, faults)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.export import make_shards, train_model
from tests.helpers.folders import make_imagefolder

# Offline and quiet: no telemetry from DVC or Prefect during tests.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")


@pytest.fixture
def imagefolder(tmp_path: Path) -> Path:
    return make_imagefolder(tmp_path / "images")


@pytest.fixture(scope="session")
def export_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny shards for the export, inference and regression-gate tests, made once per session."""

    return make_shards(tmp_path_factory.mktemp("export-data"))


@pytest.fixture(scope="session")
def export_model_file(export_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model.pt trained once on `export_shards`; tests that alter it work on copies."""

    return train_model(export_shards, tmp_path_factory.mktemp("export-model"))


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[None]:
    """One temporary Prefect server for the whole session (it takes about 13 s to start)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
