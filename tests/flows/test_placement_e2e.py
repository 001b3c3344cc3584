"""Stage placement across two "machines": one Prefect server, the local-process and gpu work pools, and a
worker for each in a checkout of its own (own PREFECT_HOME, own DVC cache), sharing only a bare git remote
and a local-directory DVC remote. prefect.yaml's `placement: {train: gpu}` is the one declaration.

A train-flow/prod run trains in the gpu checkout, as a run-stage/gpu subflow under the parent's train
task, and finishes in the first; its dvc.lock equals a single-machine `dvc repro`'s. A second run
sends nothing and skips every stage. The gpu worker and its runs SIGKILLed mid-training: the subflow and
the parent end Crashed within the automation's window; a retry of the parent resumes training on the
gpu pool from its checkpoint and ends with a single-machine run's dvc.lock again.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasks.core.io import read_json
from tests.helpers.prefect import RULES, Production, free_port, kill_worker_and_its_runs, prefect_env
from tests.helpers.project import ROOT, TINY, commit, deep_update, dvc, make_project, sh, stale_stages, write_params

pytestmark = pytest.mark.slow

CRASH_AFTER_S = 60  # the automation's window (heartbeats every 30 s, prefect.yaml)
UPDATE: dict[str, Any] = {"regression": {"rules": RULES}, "train": {"checkpoint_every_steps": 2}}
LONGER = deep_update(UPDATE, {"train": {"epochs": 12}})  # long enough to be killed mid-training


class Machines:
    def __init__(self, here: Production, gpu: Production) -> None:
        self.here, self.gpu = here, gpu

    def gpu_runs(self) -> list[Any]:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

        with self.here.client(), get_client(sync_client=True) as client:
            return client.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["gpu"])))

    def parent_of(self, child: Any) -> Any:
        from prefect.client.orchestration import get_client

        with self.here.client(), get_client(sync_client=True) as client:
            return client.read_flow_run(client.read_task_run(child.parent_task_run_id).flow_run_id)


@pytest.fixture
def machines(tmp_path: Path) -> Iterator[Machines]:
    remote_git, remote_dvc = tmp_path / "remote.git", tmp_path / "dvc-remote"
    sh(["git", "init", "-q", "--bare", str(remote_git)], cwd=tmp_path)
    here = make_project(tmp_path / "here", UPDATE)
    shutil.copytree(ROOT / "scripts", here / "scripts")
    declared = (ROOT / "prefect.yaml").read_text()
    assert "      placement: {}\n" in declared
    (here / "prefect.yaml").write_text(declared.replace("      placement: {}\n", "      placement: {train: gpu}\n"))
    dvc("remote", "add", "-d", "storage", str(remote_dvc), cwd=here)
    commit(here, "the project, train placed on the gpu pool")
    sh(["git", "remote", "add", "origin", str(remote_git)], cwd=here)
    sh(["git", "push", "-q", "-u", "origin", "HEAD:main"], cwd=here)
    gpu_checkout = tmp_path / "gpu"
    sh(["git", "clone", "-q", "-b", "main", str(remote_git), str(gpu_checkout)], cwd=tmp_path)

    port = free_port()
    env = prefect_env(tmp_path / "home-here", port, IMAGEPIPE_CRASH_AFTER_S=str(CRASH_AFTER_S))
    env["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
    gpu_env = {**prefect_env(tmp_path / "home-gpu", port), "PREFECT_API_URL": env["PREFECT_API_URL"], "POOL": "gpu"}
    first, gpu = Production(here, env), Production(gpu_checkout, gpu_env)
    try:
        for step in ("server", "pool", "deploy", "worker"):
            first.script(step)
        gpu.script("worker")
        yield Machines(first, gpu)
    finally:
        gpu.script("stop")
        first.script("stop")


def lock(repo: Path) -> dict[str, Any]:
    return yaml.safe_load((repo / "dvc.lock").read_text())


def single_machine_lock(root: Path, update: dict[str, Any]) -> dict[str, Any]:
    plain = make_project(root, update)
    dvc("repro", cwd=plain)
    return lock(plain)


def test_train_placed_on_the_gpu_pool_runs_there_crashes_loudly_and_resumes(machines: Machines, tmp_path: Path) -> None:
    here, gpu = machines.here.repo, machines.gpu.repo

    # 1. One run: training happens in the gpu checkout, the rest here.
    proc, run = machines.here.run_and_watch("train-flow/prod")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert run.state.is_completed(), run.state
    (child,) = machines.gpu_runs()
    assert child.state.is_completed() and machines.parent_of(child).id == run.id  # a subflow of this run
    assert "epoch 1:" in machines.here.logs(child.id, wait_for="epoch 1:")
    assert (gpu / "models" / "model.pt").is_file() and any((gpu / "runs" / "checkpoints").iterdir())
    assert not (here / "runs" / "checkpoints").exists()  # nothing trained here...
    assert (here / "models" / "model.pt").read_bytes() == (gpu / "models" / "model.pt").read_bytes()  # ...but here
    manifest = read_json(here / "reports" / "run_manifest.json")
    assert manifest["stages"]["train"] == "ran" and manifest["stages"]["check_regression"] == "ran", manifest
    assert stale_stages(here) == {}
    untracked = sh(["git", "status", "--porcelain", "--untracked-files=all"], cwd=here).stdout
    assert "model.pt" not in untracked and "/model.pt" in (here / "models" / ".gitignore").read_text()
    assert lock(here) == single_machine_lock(tmp_path / "plain", UPDATE)
    commit(here, "first production run")
    sh(["git", "push", "-q", "origin", "HEAD:main"], cwd=here)  # the gpu machine checks out pushed commits

    # 2. Nothing changed: nothing is sent to the gpu pool, every stage is skipped (the environment stage
    # rechecks this machine every time, and finds it the same).
    proc, run = machines.here.run_and_watch("train-flow/prod")
    assert proc.returncode == 0, proc.stderr[-3000:]
    stages = read_json(here / "reports" / "run_manifest.json")["stages"]
    assert {name: outcome for name, outcome in stages.items() if name != "dvc push"} == {
        **{name: "unchanged" for name in lock(here)["stages"]},
        "environment": "ran",
    }
    assert len(machines.gpu_runs()) == 1

    # 3. The gpu machine dies mid-training: its run and the parent end Crashed, not Running.
    write_params(here, deep_update(TINY, LONGER))  # sent along uncommitted, like `dvc exp run -S` would
    started = machines.here.prefect("deployment", "run", "train-flow/prod")
    assert started.returncode == 0, started.stderr
    deadline = time.monotonic() + 600
    while not (runs := [r for r in machines.gpu_runs() if r.id != child.id]) or "epoch 2:" not in machines.here.logs(
        runs[0].id, timeout=0
    ):
        assert time.monotonic() < deadline, "training on the gpu pool never reached epoch 2"
        time.sleep(2)
    (crashed_child,) = runs
    parent = machines.parent_of(crashed_child)
    killed_at = kill_worker_and_its_runs(Path(machines.gpu.env["PREFECT_HOME"]))
    while not (state := machines.here.flow_run(parent.id).state).is_final():
        waited = time.time() - killed_at
        assert waited < CRASH_AFTER_S + 120, f"the parent is still {state.name} {waited:.0f} s after the kill"
        time.sleep(3)
    child_state = machines.here.flow_run(crashed_child.id).state
    assert child_state.is_crashed() and "no heartbeat" in (child_state.message or ""), child_state
    assert state.is_crashed() and "crashed" in (state.message or ""), state
    detected_s = state.timestamp.timestamp() - killed_at
    print(f"parent Crashed {detected_s:.0f} s after the kill (automation window {CRASH_AFTER_S} s)")
    assert detected_s <= CRASH_AFTER_S + 60

    # 4. The gpu worker is back; retrying the parent resumes training there, finished stages stay skipped.
    machines.gpu.script("worker")
    retried = machines.here.prefect("flow-run", "retry", str(parent.id))
    assert retried.returncode == 0, retried.stdout + retried.stderr
    deadline = time.monotonic() + 900
    while not (state := machines.here.flow_run(parent.id).state).is_final() or state.name == "AwaitingRetry":
        assert time.monotonic() < deadline, f"the retried run is still {state.name}"
        time.sleep(3)
    assert state.is_completed(), state
    resumed = [r for r in machines.gpu_runs() if r.id not in (child.id, crashed_child.id)]
    assert len(resumed) == 1 and "resuming from" in machines.here.logs(resumed[0].id, wait_for="resuming from")
    stages = read_json(here / "reports" / "run_manifest.json")["stages"]
    assert stages["generate"] == stages["preprocess"] == "unchanged" and stages["train"] == "ran", stages
    assert lock(here) == single_machine_lock(tmp_path / "plain-longer", LONGER)
