"""The issue's check of a sweep over machines: 4 trials over two Prefect workers, each in a clone of its own, the
study in a real PostgreSQL, the runs in a real MLflow tracking server. Both workers ran trials; `dvc exp show` in
the study's checkout lists all 4 (each pushed by its worker, pulled by the study); MLflow holds one parent run with
the 4 trials as children. Its fast parts (the database, heartbeats, refusals): tests/flows/test_sweep_storage.py."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from flows.sweep import report
from tasks.release import tracking
from tests.helpers.project import dvc
from tests.helpers.sweep_machines import sweep_machines

pytestmark = pytest.mark.slow  # about 4 minutes on 2 cores: 4 trials of a tiny pipeline, two at a time


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
