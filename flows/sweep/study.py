"""The sweep's Optuna study: its storage (flows/sweep/storage.py: the journal under runs/sweep/, or a database),
one sweep at a time per study, resume.

Sampler: TPE, seeded by sweep.sampler_seed, so a sweep run one trial at a time asks the same values again.
Pruner: sweep.pruner on each epoch's validation accuracy (the trial reports it as its intermediate value):
- median (the default): a trial is stopped after an epoch where it is below the median of the trials before
  it at that epoch, once sweep.startup_trials have finished and after sweep.warmup_epochs. With a dozen
  trials of a handful of epochs, every trial is compared with every earlier one;
- hyperband: Optuna's HyperbandPruner (successive halving in brackets). Its brackets split a dozen trials into
  groups that are only compared within themselves, so it pays off with many more trials than a 2-core machine
  runs; it is there for larger sweeps;
- none: every trial runs to its end.
A killed sweep leaves its running trials in state RUNNING in the journal: `resume` marks them failed and
queues their values again, so the same command retries them; finished and pruned trials are kept.
"""

from __future__ import annotations

import fcntl
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import optuna
from optuna.trial import TrialState

from flows.sweep.storage import open_storage
from tasks.core.experiment_params import SweepParams

DIRECTION = "maximize"  # validation accuracy
UID = "sweep_uid"


class SweepBusy(RuntimeError):
    """Another sweep holds this study's lock: one line."""


def journal_path(runs: Path, study: str) -> Path:
    return runs / "sweep" / f"{study}.journal"


@contextmanager
def study_lock(runs: Path, study: str) -> Iterator[Path]:
    """Hold runs/sweep/<study>.lock for the sweep's life; a second sweep of the same study is refused at once.
    flock is released by the kernel when the holder dies (kill -9 included), so a killed sweep never blocks."""
    path = runs / "sweep" / f"{study}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise SweepBusy(
                f"sweep {study!r} is already running ({holder}, lock {path}); wait for it, or give "
                "another study: make sweep STUDY=<name>"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}")
        handle.flush()
        yield path


def pruner(params: SweepParams, epochs: int) -> optuna.pruners.BasePruner:
    if params.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=params.startup_trials, n_warmup_steps=params.warmup_epochs)
    if params.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=max(epochs, 1), reduction_factor=3)
    return optuna.pruners.NopPruner()


def open_study(runs: Path, params: SweepParams, epochs: int) -> optuna.Study:
    storage = open_storage(params.storage, journal_path(runs, params.study), params.heartbeat_s)
    study = optuna.create_study(
        study_name=params.study,
        storage=storage,
        direction=DIRECTION,
        # Optuna's default of 10 random trials first would leave a 12-trial study 2 guided ones: a third, 2 to 10
        sampler=optuna.samplers.TPESampler(
            seed=params.sampler_seed, n_startup_trials=min(10, max(2, params.trials // 3))
        ),
        pruner=pruner(params, epochs),
        load_if_exists=True,
    )
    if UID not in study.user_attrs:  # a new journal (or database): a new study, even under an old name
        study.set_user_attr(UID, uuid.uuid4().hex)
    return study


def trial_name(study_name: str, trial: optuna.trial.FrozenTrial | optuna.Trial) -> str:
    """A trial's name (its DVC experiment's and MLflow run's): the one it was given when asked, else
    `<study>-tNNN`; every part of the sweep asks here."""
    return str(trial.user_attrs.get("name") or f"{study_name}-t{trial.number:03d}")


def study_uid(study: optuna.Study) -> str:
    """This study's identity, kept in its journal: the same after a resume, new after the journal is deleted."""
    return str(study.user_attrs[UID])


def resume(study: optuna.Study) -> list[int]:
    """Trials a killed sweep left RUNNING: marked failed, their values queued again. Returns their numbers."""
    stale = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.RUNNING]
    for trial in stale:
        study.tell(trial.number, state=TrialState.FAIL)
        study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})
    return [t.number for t in stale]


def counted(study: optuna.Study) -> int:
    """Trials that count toward sweep.trials: finished or pruned (a failed one is retried, not counted)."""
    return sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in study.get_trials(deepcopy=False))
