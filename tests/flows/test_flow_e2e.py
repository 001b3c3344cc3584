"""Production, end to end: a real Prefect server, work pool, deployments and worker started by scripts/prefect.sh
(what `make prefect-up` runs) on a tiny committed project; runs started with `prefect deployment run`.

Checks the acceptance of the Prefect issue: a completed train-flow/prod run whose tasks, logs and artifacts
the API returns; dvc.lock equal to a plain `dvc repro`; a second run that skips every stage; the worker
killed mid-training -> Crashed by the heartbeat automation -> the rerun resumes from the checkpoint; the
nightly deployment's cron schedule, and a planted worse model failing it with the verdict in its artifact.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from flows.artifacts import KEYS
from tasks.core.dag import load_stages
from tasks.core.io import read_json, sha256_file, write_json
from tests.helpers.prefect import (
    RULES,
    Production,
    kill_worker_and_its_runs,
    production_project,
    worsen_onnx,
)
from tests.helpers.project import TINY, commit, deep_update, dvc, make_project, sh, stale_stages, write_params

pytestmark = pytest.mark.slow

CRASH_AFTER_S = 60  # the automation's window in this test (heartbeats every 30 s, prefect.yaml)
UPDATE: dict[str, Any] = {"regression": {"rules": RULES}, "train": {"checkpoint_every_steps": 2}}


@pytest.fixture
def production(tmp_path: Path) -> Iterator[Production]:
    """A committed tiny project with prefect.yaml and scripts/, and a server, pool, deployments and worker."""
    with production_project(tmp_path, UPDATE, IMAGEPIPE_CRASH_AFTER_S=str(CRASH_AFTER_S)) as prod:
        yield prod


def test_production_run_crash_resume_and_nightly(production: Production, tmp_path: Path) -> None:
    repo = production.repo
    stages = set(load_stages(repo))

    # 1. `prefect deployment run train-flow/prod --watch` completes; the API has its tasks, logs, artifacts.
    proc, run = production.run_and_watch("train-flow/prod")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert run.state.is_completed()
    tasks = production.task_runs(run.id)
    assert stages <= set(tasks) and all(tasks[name].state.is_completed() for name in stages)
    logs = production.logs(run.id, wait_for="Running stage 'check_regression'")
    assert all(f"Running stage '{name}'" in logs for name in stages) and "epoch 1:" in logs
    assert {KEYS["evaluate"], KEYS["export"], KEYS["check_regression"], KEYS["manifest"]} <= set(
        production.artifacts(run.id)
    )
    manifest = read_json(repo / "reports/run_manifest.json")
    assert manifest["prefect"] == {"deployment": "prod", "flow_run_id": str(run.id), "flow_run_name": run.name}
    assert manifest["git"]["commit"] == sh(["git", "rev-parse", "HEAD"], cwd=repo).stdout.strip()

    # dvc.lock is what a plain `dvc repro` of the same commit writes.
    assert stale_stages(repo) == {}
    plain = make_project(tmp_path / "plain", UPDATE)
    dvc("repro", cwd=plain)
    assert yaml.safe_load((repo / "dvc.lock").read_text()) == yaml.safe_load((plain / "dvc.lock").read_text())
    commit(repo, "first production run")

    # 2. A second run skips every stage but the environment stage, which rechecks the machine every time,
    # and the gate, which enforces its verdict every time (its scores reused).
    proc, run = production.run_and_watch("train-flow/prod")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_json(repo / "reports/run_manifest.json")["stages"] == {
        **{name: "unchanged" for name in stages},
        "environment": "ran",
        "check_regression": "ran",
        "dvc push": "no remote",
    }

    # 3. The worker dies mid-training: the heartbeat automation marks the run Crashed; a rerun resumes.
    write_params(repo, deep_update(deep_update(TINY, UPDATE), {"train": {"epochs": 12}}))
    started = production.prefect("deployment", "run", "train-flow/prod")
    assert started.returncode == 0, started.stderr
    deadline = time.monotonic() + 600
    while "epoch 2:" not in production.logs(production.latest_run("prod").id, timeout=0):
        assert time.monotonic() < deadline, "training never reached epoch 2"
        time.sleep(2)
    crashed = production.latest_run("prod")
    killed_at = kill_worker_and_its_runs(Path(production.env["PREFECT_HOME"]))
    while (state := production.flow_run(crashed.id).state).is_running():
        assert time.time() - killed_at < CRASH_AFTER_S + 90, f"still {state.name} {time.time() - killed_at:.0f} s on"
        time.sleep(3)
    assert state.is_crashed() and "no heartbeat" in (state.message or ""), state
    detected_s = state.timestamp.timestamp() - killed_at
    print(f"Crashed {detected_s:.0f} s after the kill (automation window {CRASH_AFTER_S} s)")
    assert detected_s <= CRASH_AFTER_S + 30

    production.script("worker")
    proc, rerun = production.run_and_watch("train-flow/prod")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert rerun.id != crashed.id and rerun.state.is_completed()
    assert "resuming from" in production.logs(rerun.id, wait_for="resuming from")

    # 4. The nightly deployment keeps its cron schedule; a planted worse model fails it with its verdict.
    schedules = production.deployment("regression-flow/nightly").schedules
    assert [s.schedule.cron for s in schedules] == ["0 2 * * *"]
    # Before any promote (the schedule runs from deploy time): a verdict that says what to do, through
    # `make prefect-run DEPLOYMENT=regression-flow/nightly`'s command.
    launched = subprocess.run([str(repo / "scripts" / "prefect.sh"), "run", "regression-flow/nightly"],
                              env=production.env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert launched.returncode == 1, launched.stdout + launched.stderr
    assert "regression-flow/nightly: Failed: no baseline yet" in launched.stdout and "make promote" in launched.stdout
    assert "Traceback" not in launched.stdout + launched.stderr
    sh(["python", "-m", "tasks.tools.promote"], cwd=repo)
    proc, nightly = production.run_and_watch("regression-flow/nightly")
    assert proc.returncode == 0 and nightly.state.is_completed(), proc.stdout[-3000:]
    onnx_path, record = repo / "baseline/model.onnx", repo / "baseline/model.json"
    worsen_onnx(onnx_path)
    write_json(record, {**read_json(record), "onnx_sha256": sha256_file(onnx_path)})
    proc, nightly = production.run_and_watch("regression-flow/nightly")
    assert proc.returncode != 0 and nightly.state.is_failed()
    verdict = production.artifacts(nightly.id)[KEYS["nightly"]].data
    assert "REGRESSION" in verdict and "loss (lower)" in verdict
