"""Seed reruns: with sweep.seeds > 1, the best `rerun_top` configurations run again with seeds seed+1 ..
seed+seeds-1, so the comparison can tell a gap from seed noise.

Their validation accuracies are kept in runs/sweep/<study>.seeds.json under the study's uid (the journal's,
which the MLflow parent carries too): a resumed sweep reruns only what is missing, and a study started over
after its journal was deleted, whose trials have the same names as the old study's, never takes the old
values for its own (it finds another uid there, and starts the file again).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from flows.sweep.study import trial_name
from flows.sweep.trial import TrialResult
from tasks.core.experiment_params import SweepParams
from tasks.core.io import read_json, write_json

# (rerun's name, the trial's number, its values, the seed, its MLflow tag) -> the finished rerun
Submit = Callable[[str, int, dict[str, Any], int, str], TrialResult]


def seeds_path(runs: Path, study: str) -> Path:
    return runs / "sweep" / f"{study}.seeds.json"


def load(path: Path, uid: str) -> dict[str, dict[str, float]]:
    """This study's reruns so far: trial name -> {seed: validation accuracy}. A file of another study (or from
    before the uid was kept) holds none of them."""
    data = read_json(path) if path.is_file() else {}
    return dict(data.get("reruns") or {}) if isinstance(data, dict) and data.get("study_uid") == uid else {}


def rerun_seeds(
    study: optuna.Study, sweep: SweepParams, seed: int, path: Path, uid: str, submit: Submit, log: Any
) -> dict[str, list[float]]:
    """Run what is missing of the best configurations' seed reruns, one at a time, keeping each in `path` as it
    finishes. Returns trial name -> the reruns' validation accuracies."""
    if sweep.seeds <= 1:
        return {}
    done = load(path, uid)
    best = sorted(
        (t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE), key=lambda t: -t.value
    )[: sweep.rerun_top]
    for trial in best:
        name = trial_name(sweep.study, trial)
        for k in range(1, sweep.seeds):
            if str(seed + k) in done.get(name, {}):
                continue
            rerun = f"{name}-seed{seed + k}"
            log.info("seed rerun %s: %s with seed %d", rerun, dict(trial.params), seed + k)
            result = submit(
                rerun, trial.number, dict(trial.params), seed + k, f"{sweep.study}:{trial.number}:seed{seed + k}"
            )
            if result.state == "complete" and result.val_accuracy is not None:
                done.setdefault(name, {})[str(seed + k)] = result.val_accuracy
                write_json(path, {"study_uid": uid, "reruns": done})
            else:
                log.warning("seed rerun %s %s: %s", rerun, result.state, result.message)
    return {name: list(values.values()) for name, values in done.items()}
