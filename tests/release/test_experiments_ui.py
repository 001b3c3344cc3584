"""`make experiments`: the real MLflow UI over the project's mlflow.db, on the port in params.yaml."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tasks.core.params import load_params
from tasks.release import tracking
from tests.helpers.prefect import free_port
from tests.helpers.project import ROOT
from tests.helpers.tracking import finished_project


def _experiments(root: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tasks.tools.experiments"],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


@pytest.mark.slow  # the default suite's budget (issue 59 item 4): make test-slow runs it
def test_make_experiments_serves_the_table_on_the_params_port_and_refuses_what_it_cannot(tmp_path: Path) -> None:
    """`make experiments` as a user runs it: the real MLflow UI over mlflow.db, its REST API answering with
    the logged run, and the address it prints is the project's runs table (MLflow 3's home is its GenAI
    overview); a missing table, a taken port and a tracking server each get one line."""
    root = finished_project(tmp_path / "proj")
    port = free_port()
    text = (root / "params.yaml").read_text()
    assert "ui_port: 5000" in text
    (root / "params.yaml").write_text(text.replace("ui_port: 5000", f"ui_port: {port}"))
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = str(ROOT)

    missing = _experiments(root, env)
    out = missing.communicate(timeout=120)[0]
    assert missing.returncode == 2 and "no experiment table yet" in out and "make run" in out, out

    server = _experiments(root, env | {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}"})
    out = server.communicate(timeout=120)[0]
    assert server.returncode == 0 and "open that address in a browser" in out, out

    params = load_params(root / "params.yaml")
    run_id = tracking.mirror(params, root)
    assert run_id
    ui = _experiments(root, env)
    experiment_id = None
    try:
        found = None
        deadline = time.monotonic() + 120
        while found is None and time.monotonic() < deadline and ui.poll() is None:
            try:
                experiment = _get(
                    f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/get-by-name?experiment_name=imagepipe"
                )
                experiment_id = experiment["experiment"]["experiment_id"]
                found = _post(
                    f"http://127.0.0.1:{port}/api/2.0/mlflow/runs/search", {"experiment_ids": [experiment_id]}
                )
            except OSError:
                time.sleep(0.5)
        assert found is not None, ui.stdout.read() if ui.poll() is not None else "no answer in 120 s"
        [run] = found["runs"]
        assert run["info"]["run_id"] == run_id
        assert {"key": "test_accuracy", "value": 0.9} in [
            {"key": m["key"], "value": m["value"]} for m in run["data"]["metrics"]
        ]
        assert (urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10).status) == 200  # the UI's page

        taken = _experiments(root, env)
        out = taken.communicate(timeout=120)[0]
        assert taken.returncode == 2 and f"port {port} on 127.0.0.1 is taken" in out, out
    finally:
        os.killpg(ui.pid, signal.SIGINT)
        try:
            ui.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(ui.pid, signal.SIGKILL)
            ui.wait()
    printed = ui.stdout.read()  # the address printed is the project's runs table, not MLflow's home
    assert f"'imagepipe': http://127.0.0.1:{port}/#/experiments/{experiment_id}/runs " in printed, printed


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return json.loads(answer.read())


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.loads(answer.read())
