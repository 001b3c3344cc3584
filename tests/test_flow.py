"""train-flow against a real (temporary) Prefect API: every dvc.yaml stage runs as a task through DVC."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from flows.dag import load_stages
from tests.conftest import make_project


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[None]:
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def test_train_flow_runs_the_dvc_stages(prefect_api: None, tmp_path: Path) -> None:
    from prefect.states import State

    from flows.train_flow import train_flow

    repo = make_project(tmp_path / "repo")
    done = train_flow(repo_dir=str(repo))
    assert sorted(done) == sorted(load_stages(repo))
    assert (repo / "dvc.lock").is_file() and (repo / "models/model.onnx").is_file()

    (repo / "baseline" / "metrics.json").write_text(json.dumps({"accuracy": 1.0, "macro_f1": 1.0}))
    state: State = train_flow(repo_dir=str(repo), return_state=True)
    assert state.is_failed()
    with pytest.raises(Exception, match=r"stage 'check_regression' failed[\s\S]*REGRESSION"):
        state.result()
