"""A sweep over "machines" on one: a real PostgreSQL (the study), a real MLflow tracking server, a Prefect server
with the project's pools and deployments, a bare git remote and a local-folder DVC remote, the study's checkout
(a tiny committed run, pushed), and one Prefect worker of the `trials` pool per clone, each clone with its own
PREFECT_HOME and DVC cache, started as a user starts them (`scripts/prefect.sh worker`, POOL=trials LIMIT=1).
Used by tests/flows/test_sweep_machines.py and bench/bench_sweep_workers.py."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.helpers.folders import make_imagefolder
from tests.helpers.postgres import postgres_server
from tests.helpers.prefect import VENV, Production, free_port, prefect_env
from tests.helpers.project import ROOT, commit, dvc, make_project, sh

POOL = "trials"
SPACE = {"train.lr": {"low": 0.001, "high": 0.2, "log": True}}


@dataclass
class Machines:
    study: Production  # the study's checkout, with the Prefect server
    workers: list[Production]
    storage: str  # the study's database URL
    tracking: str  # the MLflow tracking server
    logs: list[str] = field(default_factory=list)

    def sweep(self, trials: int, parallel: int, study: str, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
        """`make sweep`'s command in the study's checkout, on the shared Prefect server and MLflow server."""
        proc = self.start_sweep(trials, parallel, study)
        out, _ = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")

    def start_sweep(self, trials: int, parallel: int, study: str) -> subprocess.Popen[str]:
        env = {**self.study.env, "MLFLOW_TRACKING_URI": self.tracking}
        command = [sys.executable, "-m", "flows.sweep_flow", "--trials", str(trials), "--parallel", str(parallel),
                   "--study", study]  # fmt: skip
        return subprocess.Popen(command, cwd=self.study.repo, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip


@contextlib.contextmanager
def mlflow_server(folder: Path) -> Iterator[str]:
    port = free_port()
    folder.mkdir(parents=True, exist_ok=True)
    command = [str(VENV / "bin" / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
               "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
               "--artifacts-destination", str(folder / "artifacts")]  # fmt: skip
    log = open(folder / "server.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{url}/health", timeout=2).read()
                break
            assert proc.poll() is None and time.monotonic() < deadline, (folder / "server.log").read_text()[-2000:]
            time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
        log.close()


def study_project(root: Path, sweep: dict[str, Any]) -> Path:
    """A committed tiny run on a 3-colour folder (as tests/flows/test_sweep.py's), its sweep in a database."""
    source = make_imagefolder(root / "images", classes=3, per_class=30)
    repo = make_project(root / "study", {
        "data": {"source": str(source)},
        "train": {"epochs": 2, "batch_size": 8, "lr": 0.05, "warmup_epochs": 0},
        "export": {"formats": ["onnx"]},
        "tracking": {"enabled": True},
        "sweep": {"pruner": "none", "pool": POOL, **sweep},
    })  # fmt: skip
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["sweep"]["space"] = SPACE
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    shutil.copytree(ROOT / "scripts", repo / "scripts")
    shutil.copy2(ROOT / "prefect.yaml", repo / "prefect.yaml")
    return repo


@contextlib.contextmanager
def sweep_machines(work: Path, workers: int, cores: list[set[int]] | None = None, heartbeat_s: int = 10,
                   no_remote: int | None = None) -> Iterator[Machines]:  # fmt: skip
    """`workers` clones with a worker each; `cores`: the CPUs each worker (and so its trials) may use; `no_remote`:
    the clone whose DVC remote is an empty folder (a machine that cannot reach the project's remote)."""
    remote_git, remote_dvc = work / "remote.git", work / "dvc-remote"
    sh(["git", "init", "-q", "--bare", str(remote_git)], cwd=work)
    with postgres_server() as storage, mlflow_server(work / "mlflow") as tracking:
        repo = study_project(work, {"storage": storage, "heartbeat_s": heartbeat_s})
        dvc("remote", "add", "-d", "storage", str(remote_dvc), cwd=repo)
        dvc("repro", cwd=repo)
        commit(repo, "the run record; its sweep over machines")
        sh(["git", "remote", "add", "origin", str(remote_git)], cwd=repo)
        sh(["git", "push", "-q", "-u", "origin", "HEAD:main"], cwd=repo)
        port = free_port()
        api = f"http://127.0.0.1:{port}/api"
        env = {**prefect_env(work / "home-study", port), "PREFECT_API_URL": api}
        study = Production(repo, env)
        started: list[Production] = []
        try:
            for step in ("server", "pool", "deploy"):
                study.script(step)
            for n in range(workers):
                clone = work / f"machine-{n}"
                sh(["git", "clone", "-q", "-b", "main", str(remote_git), str(clone)], cwd=work)
                if n == no_remote:
                    (work / "nowhere").mkdir()
                    dvc("remote", "modify", "--local", "storage", "url", str(work / "nowhere"), cwd=clone)
                worker_env = {**prefect_env(work / f"home-{n}", port), "PREFECT_API_URL": api, "POOL": POOL,
                              "LIMIT": "1", "PREFECT_WORKER_QUERY_SECONDS": "2"}  # fmt: skip
                machine = Production(clone, worker_env)
                machine.script("worker")
                started.append(machine)
                if cores:  # the worker's flow runs, and their trials, inherit its CPUs
                    pid = int((work / f"home-{n}" / "worker.pid").read_text())
                    for thread in Path(f"/proc/{pid}/task").iterdir():  # every thread: any of them may spawn a run
                        os.sched_setaffinity(int(thread.name), cores[n])
            yield Machines(study, started, storage, tracking)
        finally:
            for machine in started:
                machine.script("stop")
            study.script("stop")
