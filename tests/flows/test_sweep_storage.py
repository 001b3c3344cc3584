"""sweep.storage and a sweep over machines, the fast parts: the param's checks, an unreachable database refused in
one line before any trial, heartbeats on a real PostgreSQL (a trial whose machine went silent is failed and its
values asked again), and a worker whose DVC remote lacks the trial's inputs failing the trial with their names.
The sweep over two Prefect workers in two clones is tests/flows/test_sweep_machines.py (slow)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from optuna.distributions import FloatDistribution

from flows.sweep.storage import beating, fail_stale, retry_of
from flows.sweep.study import open_study
from flows.sweep.trial import TrialResult, run_trial
from tasks.core.experiment_params import SweepParams
from tasks.core.params import ParamsError, load_params
from tests.helpers.postgres import postgres_server
from tests.helpers.prefect import free_port
from tests.helpers.project import ROOT, commit, dvc, make_project, sh

pytestmark = pytest.mark.fast

LR = {"train.lr": FloatDistribution(1e-6, 0.2, log=True)}


@pytest.fixture(scope="module")
def postgres() -> Iterator[str]:
    with postgres_server() as url:
        yield url


def test_sweep_storage_is_a_database_url_and_a_pool_needs_one(tmp_path: Path) -> None:
    assert SweepParams().storage == "" and SweepParams().pool == ""  # the default: the journal, trials here
    assert SweepParams(storage="postgresql://optuna@db.example:5432/studies", pool="trials").pool == "trials"
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    for sweep, words in (
        ({"storage": "runs/sweep/studies.db"}, "sweep.storage 'runs/sweep/studies.db' is not a database URL"),
        ({"pool": "trials"}, "sweep.pool 'trials' needs sweep.storage: a database every machine reaches"),
        ({"heartbeat_s": 0}, "heartbeat_s"),
    ):
        raw["sweep"] = {**raw["sweep"], **sweep}
        (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
        with pytest.raises(ParamsError, match=words):
            load_params(tmp_path / "params.yaml")
        raw["sweep"] = {k: v for k, v in raw["sweep"].items() if k not in sweep}


def test_an_unreachable_storage_is_refused_in_one_line_naming_it_before_any_trial(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    url = f"postgresql://alice:s3cret@127.0.0.1:{port}/studies"
    repo = make_project(tmp_path / "repo", {"sweep": {"storage": url}})
    commit(repo, "a study in a database")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "flows.sweep_flow", "--trials", "1"], cwd=repo, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: sweep.storage postgresql://alice:***@127.0.0.1:{port}/studies cannot be reached")
    assert "s3cret" not in proc.stdout + proc.stderr
    assert not (repo / "runs" / "sweep" / "default").exists()  # no trial folder: nothing started
    assert time.monotonic() - started < 60  # before Prefect's temporary server (about 13 s) would start


def test_a_trial_whose_machine_stopped_beating_is_failed_and_its_values_asked_again(
    postgres: str, tmp_path: Path
) -> None:
    sweep = SweepParams(study="heartbeats", storage=postgres, heartbeat_s=1, pruner="none")
    study = open_study(tmp_path / "runs", sweep, 3)
    dead = study.ask(LR)
    alive = study.ask(LR)
    storage = study._storage
    with beating(storage, alive._trial_id):
        with beating(storage, dead._trial_id):
            time.sleep(1.5)
        assert fail_stale(study) == []  # both beat within the grace period (3 heartbeats)
        time.sleep(4)  # the dead one's machine is silent; the live one beats on
        assert fail_stale(study) == [dead.number]
    states = {t.number: t.state.name for t in study.get_trials()}
    assert states == {dead.number: "FAIL", alive.number: "RUNNING", 2: "WAITING"}
    again = study.ask(LR)  # the retry callback queued the dead trial's values: the next ask runs them
    assert again.number == 2 and again.params == dead.params and retry_of(study, again.number) == dead.number
    assert retry_of(study, alive.number) is None
    # another process, the study reopened from the database (a resumed sweep), sees the same
    reopened = open_study(tmp_path / "elsewhere", sweep, 3)
    assert {t.number: t.state.name for t in reopened.get_trials()}[dead.number] == "FAIL"


def test_a_worker_whose_dvc_remote_lacks_the_inputs_fails_the_trial_naming_them(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    sh(["git", "init", "-q"], cwd=repo)
    dvc("init", "-q", cwd=repo)
    (repo / "dvc.yaml").write_text("stages:\n  shards:\n    cmd: echo made > shards.txt\n    outs: [shards.txt]\n")
    dvc("repro", "-q", cwd=repo)
    dvc("remote", "add", "-d", "storage", str(tmp_path / "empty-remote"), cwd=repo)  # nothing was pushed there
    sh(["git", "add", "-A"], cwd=repo)
    sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "run"], cwd=repo)
    worker = tmp_path / "worker"
    sh(["git", "clone", "-q", str(repo), str(worker)], cwd=tmp_path)  # another machine: its own empty cache
    head = sh(["git", "rev-parse", "HEAD"], cwd=worker).stdout.strip()
    result = TrialResult(number=0, name="s-t000", values={}, seed=None)
    lines: list[str] = []
    run_trial(worker, worker / "runs", result, commit=head, env={}, report=None, log=lines.append, pull=True)
    assert result.state == "failed", result
    assert result.message.startswith("RuntimeError: inputs missing on this worker: shards.txt (`dvc pull`"), result
    assert not [p for p in (worker / "runs").iterdir()]  # its copy removed
