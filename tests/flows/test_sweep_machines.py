"""The issue's check of a sweep over machines: 4 trials over two Prefect workers, each in a clone of its own, the
study in a real PostgreSQL, the runs in a real MLflow tracking server. Both workers ran trials; `dvc exp show` in
the study's checkout lists all 4 (each pushed by its worker, pulled by the study); MLflow holds one parent run with
the 4 trials as children. And a worker killed mid-trial: its trial is failed by its heartbeat and rerun on the
other. A worker whose clone cannot reach the DVC remote fails its trials naming the missing inputs; the study
goes on with the other. The fast parts (the database, heartbeats, refusals): tests/flows/test_sweep_storage.py."""

from __future__ import annotations

import re
import time
from pathlib import Path

import optuna
import pytest

from flows.sweep import report
from flows.sweep.storage import retry_of
from tasks.release import tracking
from tests.helpers.prefect import Production, kill_worker_and_its_runs
from tests.helpers.project import dvc
from tests.helpers.sweep_machines import sweep_machines

pytestmark = pytest.mark.slow  # about 4 minutes each on 2 cores: a tiny pipeline's trials on two workers


def test_a_sweep_of_four_trials_over_two_workers_in_two_clones(tmp_path: Path) -> None:
    with sweep_machines(tmp_path, workers=2) as machines:
        proc = machines.sweep(trials=4, parallel=2, study="spread")
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        out = proc.stdout + proc.stderr
        assert "best trial: spread-t00" in out and "dvc exp apply spread-t00" in out

        study = optuna.load_study(study_name="spread", storage=machines.storage)
        trials = study.get_trials()
        assert [t.state.name for t in trials] == ["COMPLETE"] * 4, [(t.number, t.state, t.user_attrs) for t in trials]
        ran_on = {t.user_attrs["checkout"].split(":", 1)[1] for t in trials}
        assert ran_on == {str(w.repo) for w in machines.workers}  # both workers ran trials

        shown = dvc("exp", "show", "--json", cwd=machines.study.repo).stdout
        assert all(f'"spread-t00{n}"' in shown for n in range(4)), shown[-3000:]

        client = tracking.client(machines.tracking)
        exp_id = client.get_experiment_by_name("imagepipe").experiment_id
        runs = client.search_runs([exp_id])
        (parent,) = [r for r in runs if r.data.tags.get(report.PARENT_TAG) == "spread"]
        children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert sorted(r.data.tags.get("sweep.trial") for r in children) == [f"spread:{n}" for n in range(4)]
        assert parent.data.tags["sweep.best"].startswith("spread-t00")


def test_a_trial_whose_worker_dies_is_failed_by_its_heartbeat_and_rerun_on_the_other(tmp_path: Path) -> None:
    """The machine running trial 0 dies (its worker, flow run and training SIGKILLed): its heartbeat stops, the
    study fails it after three heartbeats, cancels its flow run and asks for its values again; the other worker
    runs them, and the study ends with its 2 trials."""
    with sweep_machines(tmp_path, workers=2, heartbeat_s=2) as machines:
        sweep = machines.start_sweep(trials=2, parallel=1, study="dies")
        deadline = time.monotonic() + 600
        while not (busy := [w for w in machines.workers if "[train] epoch 1:" in _log(w)]):
            assert sweep.poll() is None and time.monotonic() < deadline, "no trial reached epoch 1"
            time.sleep(1)
        (dead,) = busy
        kill_worker_and_its_runs(Path(dead.env["PREFECT_HOME"]))
        out, _ = sweep.communicate(timeout=900)
        assert sweep.returncode == 0, out[-5000:]
        assert "stopped beating" in out, out[-5000:]

        study = optuna.load_study(study_name="dies", storage=machines.storage)
        trials = {t.number: t for t in study.get_trials()}
        assert [t.state.name for t in trials.values()] == ["FAIL", "COMPLETE", "COMPLETE"], out[-5000:]
        assert retry_of(study, 1) == 0 and trials[1].params == trials[0].params  # trial 0's values, run again
        (alive,) = [w for w in machines.workers if w is not dead]
        assert {trials[n].user_attrs["checkout"].split(":", 1)[1] for n in (1, 2)} == {str(alive.repo)}
        shown = dvc("exp", "show", "--json", cwd=machines.study.repo).stdout
        assert '"dies-t001"' in shown and '"dies-t002"' in shown and '"dies-t000"' not in shown


def _log(machine: Production) -> str:
    path = Path(machine.env["PREFECT_HOME"]) / "worker.log"
    return path.read_text(errors="replace") if path.is_file() else ""


def test_a_worker_without_the_dvc_remote_fails_its_trials_naming_the_inputs_and_the_study_goes_on(
    tmp_path: Path,
) -> None:
    with sweep_machines(tmp_path, workers=2, no_remote=1) as machines:
        proc = machines.sweep(trials=2, parallel=2, study="half")
        assert proc.returncode == 0, proc.stdout[-5000:]
        healthy, cut_off = (str(w.repo) for w in machines.workers)
        study = optuna.load_study(study_name="half", storage=machines.storage)
        where = {t.number: (t.state.name, t.user_attrs["checkout"].split(":", 1)[1]) for t in study.get_trials()}
        assert sorted(s for s, w in where.values() if w == healthy) == ["COMPLETE", "COMPLETE"], where
        failed = [t for t in study.get_trials() if t.state.name == "FAIL"]
        assert failed and all(where[t.number][1] == cut_off for t in failed), where
        for trial in failed:
            assert re.match(r"RuntimeError: inputs missing on this worker: \S", trial.user_attrs["result"]["message"])
        assert "inputs missing on this worker" in proc.stdout and "best trial: half-t00" in proc.stdout
