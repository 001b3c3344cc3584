"""Prefect for tests: the project's tooling driven as a user drives it (`Production`), runs read back through
the real API (task runs, logs, artifacts), and a model made worse on purpose."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import numpy as np
import onnx
import psutil

# The crash test's planted worse model is judged by its loss: a tiny model is near chance, so only
# a loss rule tells a planted bad model from it reliably.
LOSS_RULE = {"metric": "loss", "direction": "lower", "abs_tol": 0.05}


RULES = [{"metric": "accuracy", "direction": "higher", "abs_tol": 0.02}, LOSS_RULE]


def worsen_onnx(path: Path) -> None:
    """A worse model with the same file layout: the classifier's logits negated and scaled up."""
    model = onnx.load(str(path))
    gemm = [node for node in model.graph.node if node.op_type == "Gemm"][-1]
    for tensor in model.graph.initializer:
        if tensor.name in gemm.input[1:]:
            values = onnx.numpy_helper.to_array(tensor) * np.float32(-20.0)
            tensor.CopyFrom(onnx.numpy_helper.from_array(values, tensor.name))
    onnx.save(model, str(path))


def api_task_runs(flow_run_id: UUID) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


def api_logs(flow_run_id: UUID, wait_for: str | None = None, timeout: float = 20.0) -> str:
    """All log lines of a flow run; logs are shipped in batches, so wait until `wait_for` has arrived."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + timeout
    while True:
        lines: list[str] = []
        with get_client(sync_client=True) as client:
            while batch := client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200, offset=len(lines)
            ):
                lines.extend(log.message for log in batch)
        text = "\n".join(lines)
        if wait_for is None or wait_for in text or time.monotonic() > deadline:
            return text
        time.sleep(1)


def api_artifacts(flow_run_id: UUID) -> dict[str, Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    of_run = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=of_run)
    return {artifact.key: artifact for artifact in found}


VENV = Path(sys.executable).parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prefect_env(home: Path, port: int, **extra: str) -> dict[str, str]:
    """The test's own server settings, whatever the calling shell has set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(IMAGEPIPE_VENV=str(VENV), PREFECT_HOME=str(home), PREFECT_SERVER_API_PORT=str(port), **extra)
    return env


class Production:
    """The project's Prefect tooling, driven the way a user does: scripts/prefect.sh and the prefect CLI."""

    def __init__(self, repo: Path, env: dict[str, str]) -> None:
        self.repo, self.env = repo, env

    def script(self, command: str) -> None:
        proc = subprocess.run(
            [str(self.repo / "scripts" / "prefect.sh"), command], env=self.env, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, f"prefect.sh {command}:\n{proc.stdout}\n{proc.stderr}"

    def prefect(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(VENV / "bin" / "prefect"), *args], cwd=self.repo, env=self.env, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip

    def client(self) -> contextlib.AbstractContextManager[Any]:
        from prefect.settings import PREFECT_API_URL, temporary_settings

        return temporary_settings({PREFECT_API_URL: self.env["PREFECT_API_URL"]})

    def latest_run(self, deployment: str) -> Any:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import (
            DeploymentFilter,
            DeploymentFilterName,
            FlowRunFilter,
            FlowRunFilterState,
            FlowRunFilterStateType,
        )
        from prefect.client.schemas.objects import StateType
        from prefect.client.schemas.sorting import FlowRunSort

        started = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(not_any_=[StateType.SCHEDULED])))
        with self.client(), get_client(sync_client=True) as client:
            runs = client.read_flow_runs(
                deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment])),
                flow_run_filter=started, sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=1,
            )  # fmt: skip
        return runs[0]

    def deployment(self, name: str) -> Any:
        from prefect.client.orchestration import get_client

        with self.client(), get_client(sync_client=True) as client:
            return client.read_deployment_by_name(name)

    def flow_run(self, run_id: UUID) -> Any:
        from prefect.client.orchestration import get_client

        with self.client(), get_client(sync_client=True) as client:
            return client.read_flow_run(run_id)

    def logs(self, run_id: UUID, wait_for: str | None = None, timeout: float = 30) -> str:
        with self.client():
            return api_logs(run_id, wait_for, timeout)

    def artifacts(self, run_id: UUID) -> dict[str, Any]:
        with self.client():
            return api_artifacts(run_id)

    def task_runs(self, run_id: UUID) -> dict[str, Any]:
        with self.client():
            return {run.name: run for run in api_task_runs(run_id)}

    def run_and_watch(self, deployment: str) -> tuple[subprocess.CompletedProcess[str], Any]:
        proc = self.prefect("deployment", "run", deployment, "--watch")
        return proc, self.latest_run(deployment.split("/")[1])


@contextlib.contextmanager
def production_project(work: Path, update: dict[str, Any] | None = None, **env: str) -> Iterator[Production]:
    """A committed tiny project with prefect.yaml and scripts/, and its server, pools, deployments and worker
    started by scripts/prefect.sh as a user starts them; stopped on exit."""
    from tests.helpers.project import ROOT, commit, make_project

    repo = make_project(work / "repo", update)
    shutil.copytree(ROOT / "scripts", repo / "scripts")
    shutil.copy2(ROOT / "prefect.yaml", repo / "prefect.yaml")
    commit(repo, "the project")
    settings = prefect_env(work / "prefect-home", free_port(), **env)
    settings["PREFECT_API_URL"] = f"http://127.0.0.1:{settings['PREFECT_SERVER_API_PORT']}/api"
    prod = Production(repo, settings)
    try:
        for step in ("server", "pool", "deploy", "worker"):
            prod.script(step)
        yield prod
    finally:
        prod.script("stop")


def kill_worker_and_its_runs(home: Path) -> float:
    """SIGKILL the worker and every process under it (flow run, dvc, train): the machine 'dies'."""
    worker = psutil.Process(int((home / "worker.pid").read_text()))
    victims = [worker, *worker.children(recursive=True)]
    for proc in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(victims, timeout=30)
    return time.time()
