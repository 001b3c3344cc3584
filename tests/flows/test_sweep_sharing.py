"""What parallel trials and concurrent sweeps share, and what they must not: the MLflow store (one writer at a
time: each trial's gate logs into a store of its own, copied into the project's under a lock), the CPUs (each
running trial holds its own, across studies), the checkpoints folder (refused outside the trials' checkouts,
before any trial), and a killed sweep's leftover processes (found by psutil, on any OS). Real MLflow, git,
processes and locks; no trial runs here (tests/flows/test_sweep.py runs them, slow)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flows.sweep import cpus, report
from flows.sweep.trial import clear_leftovers
from tasks.release import mlflow_store
from tests.helpers.project import ROOT, commit, env_with_venv, sh, write_params

pytestmark = pytest.mark.fast


SWEEP = """import sys, time
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from flows.sweep import report
from flows.sweep.store import Store
from tasks.release import mlflow_store
uri, runs, study, tmp = sys.argv[2], Path(sys.argv[3]), sys.argv[4], Path(sys.argv[5])
store = Store(uri)
print("ready", flush=True)
while not (tmp / "go").exists():  # both sweeps start writing at the same moment
    time.sleep(0.005)
parent = report.parent_run(store, "imagepipe", study, study + "-uid", tmp / f"{study}.journal")
own = store.for_trial(tmp / study / "mlflow")  # the trial's gate logs here, with the gate's own writer
history = [{"epoch": 1, "val_accuracy": 0.5}, {"epoch": 2, "val_accuracy": 0.75}]
tags = {mlflow_store.KEY_TAG: study + "-key", "sweep.trial": study + ":0"}
record = mlflow_store.Record(study + "-key", study + "-t000", {"train.lr": "0.08"},
                             {"accuracy": 0.9, "gate_passed": 1.0}, history, tags, [tmp / "confusion.png"])
mlflow_store.log_record(record, own, "imagepipe", parent=parent)
print(parent, *store.merge(own), *store.merge(own))  # the second merge: the record is there, nothing copied
"""


def test_two_sweeps_at_once_on_a_new_store_each_get_their_parent_and_their_trials_run(tmp_path: Path) -> None:
    """Two studies' sweeps in one project start together on a project store that does not exist yet; each one's
    trial gate logs into the trial's own store, which the sweep copies in with the run's params, each metric's
    steps, tags, artifacts and status. Without one writer at a time both sweeps create MLflow's tables at once and
    one fails (measured: 3 runs of 3; "duplicate column name", or an Alembic migration error): no parent run."""
    uri, runs = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "runs"
    (tmp_path / "confusion.png").write_bytes(b"not really a png")
    sweeps = {
        study: subprocess.Popen(
            [sys.executable, "-c", SWEEP, str(ROOT), uri, str(runs), study, str(tmp_path)],
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        for study in ("first", "second")
    }
    for proc in sweeps.values():
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n", proc.communicate()
    (tmp_path / "go").touch()
    outs = {study: proc.communicate(timeout=180) for study, proc in sweeps.items()}
    client = mlflow_store.client(uri)
    for study, (out, err) in outs.items():
        assert len(out.split()) == 2 and "None" not in out, err[-3000:]  # a parent; one run copied, once
        parent, child = out.split()
        assert client.get_run(parent).data.tags[report.PARENT_TAG] == study
        run = client.get_run(child)
        assert run.info.run_name == f"{study}-t000" and run.info.status == "FINISHED"
        assert run.data.tags["mlflow.parentRunId"] == parent and run.data.tags["sweep.trial"] == f"{study}:0"
        assert run.data.params == {"train.lr": "0.08"} and run.data.metrics["accuracy"] == 0.9
        steps = [(m.step, m.value) for m in client.get_metric_history(child, "val_accuracy")]
        assert sorted(steps) == [(1, 0.5), (2, 0.75)]
        assert [a.path for a in client.list_artifacts(child, "reports")] == ["reports/confusion.png"]


HOLDER = """import sys, time
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from flows.sweep.cpus import claimed
with claimed(Path(sys.argv[2]), int(sys.argv[3]), print) as cores:
    print(" ".join(map(str, cores)), flush=True)
    time.sleep(120)
"""


def test_trials_of_two_studies_run_on_disjoint_cpus_and_a_dead_sweeps_cpus_are_free(tmp_path: Path) -> None:
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("one CPU: nothing to split")
    runs, half = tmp_path / "runs", len(mine) // 2
    assert cpus.share(2) == half
    other = subprocess.Popen([sys.executable, "-c", HOLDER, str(ROOT), str(runs), str(half)], text=True,
                             stdout=subprocess.PIPE)  # fmt: skip  # another study's trial, in its own sweep
    try:
        assert other.stdout is not None
        theirs = {int(c) for c in other.stdout.readline().split()}
        assert len(theirs) == half, theirs
        told: list[str] = []
        with cpus.claimed(runs, half, told.append) as ours:
            assert ours and not theirs & set(ours) and set(ours) <= set(mine)
            got: list[list[int]] = []

            def third() -> None:  # every CPU is held now: it waits
                with cpus.claimed(runs, 1, told.append, poll_s=0.05) as cores:
                    got.append(cores)

            waiting = threading.Thread(target=third)
            waiting.start()
            time.sleep(0.5)
            assert not got and told and told[0].startswith("waiting for a free CPU: every one is held")
            other.kill()  # kill -9 of the other sweep: the kernel frees its CPUs
            waiting.join(timeout=30)
            assert got and len(got[0]) == 1 and got[0][0] in theirs
    finally:
        other.kill()
        other.wait()


def test_a_sweep_refuses_checkpoints_outside_the_trials_checkouts_before_any_trial(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    shared = tmp_path / "shared-checkpoints"
    write_params(repo, {"paths": {"checkpoints": str(shared)}})
    sh(["git", "init", "-q"], cwd=repo)
    commit(repo, "checkpoints on shared storage")
    head = sh(["git", "rev-parse", "HEAD"], cwd=repo).stdout.strip()
    env = {**env_with_venv(), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "flows.sweep_flow"], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr == (
        f"error: paths.checkpoints is {shared} in params.yaml at {head[:12]}, outside the trials' checkouts: every "
        "trial would train in that one folder, and a finished trial's pruning (train.keep_checkpoint_runs) could "
        "delete a running trial's checkpoints; set paths.checkpoints inside the project (the default, "
        "runs/checkpoints) and commit it\n"
    ), proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not (repo / "runs").exists()  # no study, no lock, no trial


def test_a_killed_sweeps_leftover_processes_and_folders_go(tmp_path: Path) -> None:
    """clear_leftovers finds the processes working in a leftover trial folder by their working directory
    (psutil: Linux and macOS alike), kills them, and removes the folders."""
    workdir = tmp_path / "runs" / "sweep" / "s"
    inside = workdir / "s-t000-abc" / "repo" / "src"
    inside.mkdir(parents=True)
    orphan = subprocess.Popen(["sleep", "120"], cwd=inside)  # a stage a kill -9 of the sweep left running
    bystander = subprocess.Popen(["sleep", "120"], cwd=tmp_path)
    try:
        assert clear_leftovers(workdir) == [(workdir / "s-t000-abc").resolve()]
        assert orphan.wait(timeout=10) == -signal.SIGKILL
        assert bystander.poll() is None
        assert not any(workdir.iterdir())
    finally:
        for proc in (orphan, bystander):
            proc.kill()
            proc.wait()


def test_the_trials_seed_is_the_committed_one(tmp_path: Path) -> None:
    """Trials run params.yaml as committed; the seed reruns count from that seed, not the workspace's edit."""
    from flows.sweep_flow import committed_params

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "params.yaml").write_text("seed: 42\n")
    for args in (
        ["init", "-q"],
        ["add", "params.yaml"],
        ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "p"],
    ):
        subprocess.run(["git", *args], cwd=repo, check=True)
    (repo / "params.yaml").write_text("seed: 7\n")  # not committed: no trial runs it
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert committed_params(repo, commit)["seed"] == 42
