"""The sweep's scheduler: Optuna asks for values, each becomes a trial (a Prefect task running
flows/sweep/trial.py), at most sweep.parallel at once, until the study has sweep.trials finished or pruned
trials; each ended trial is told back to the study. A failed trial is replaced; MAX_FAILURES_IN_A_ROW in a
row (on every worker, over machines) stop the sweep (a broken pipeline fails every trial). With sweep.pool
set, a trial's task dispatches it to that pool's workers instead (flows/sweep/remote.py); with sweep.storage
a database, running trials beat, and the ones whose heartbeat stopped are failed and their values asked again
(flows/sweep/storage.py)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState
from prefect import get_run_logger, task
from prefect.utilities.annotations import quote

from flows.sweep import cpus, report
from flows.sweep.remote import Remote, dispatch
from flows.sweep.space import suggest
from flows.sweep.storage import beating, fail_stale, retry_of
from flows.sweep.store import Store
from flows.sweep.study import counted, trial_name
from flows.sweep.trial import TrialResult, run_trial
from tasks.core.experiment_params import SweepParams
from tasks.release import run_record

MAX_FAILURES_IN_A_ROW = 3  # then the sweep stops, naming the last failure: a broken pipeline fails every trial


class TrialsFailing(RuntimeError):
    """Every trial fails: the pipeline itself is broken at HEAD (the message carries the last trial's log)."""


@dataclass(frozen=True)
class Run:
    """What every trial of one sweep shares."""

    sweep: SweepParams
    repo: Path
    runs: Path  # params.paths.runs of the workspace: the journal, the locks, the trials' folders
    commit: str
    epochs: int  # of the committed run: a trial is not pruned at its last epoch
    env: dict[str, str]
    extra: list[str]  # more -S for every trial (threads, where trials share a machine without CPU affinity)
    store: Store  # the project's MLflow store
    experiment: str
    parent: str | None
    seed: int
    cpus: int | None = None  # CPUs of each running trial, when trials share the machine (flows/sweep/cpus.py)
    track: bool = True  # tracking.enabled: the sweep's MLflow parent and its unfinished trials
    remote: Remote | None = None  # sweep.pool set: trials run on that pool's workers (flows/sweep/remote.py)

    @property
    def workdir(self) -> Path:
        return self.runs / "sweep" / self.sweep.study

    def submit(self, name: str, number: int, values: dict[str, Any], seed: int | None, tag: str,
               trial: optuna.Trial | None, pinned: bool = False) -> Any:  # fmt: skip
        env = {**self.env, run_record.TRIAL_ENV: tag}
        # quote: Prefect passes the Run as it is, without visiting (and rebuilding) its fields
        return trial_task.submit(quote(self), name, number, values, seed, env, trial, self.cpus if pinned else None)

    def rerun(self, name: str, number: int, values: dict[str, Any], seed: int, tag: str) -> TrialResult:
        """A seed rerun (flows/sweep/seeds.py): to its end, never pruned, on the machine's CPUs."""
        return self.submit(name, number, values, seed, tag, None).result()


@task(name="sweep-trial", task_run_name="{name}", cache_policy=None)
def trial_task(
    run: Run,
    name: str,
    number: int,
    values: dict[str, Any],
    seed: int | None,
    env: dict[str, str],
    trial: optuna.Trial | None = None,
    want_cpus: int | None = None,
) -> TrialResult:
    """One trial, reporting each epoch to its Optuna `trial` and stopped when it says prune (None: a seed rerun,
    which runs to its end); on `want_cpus` CPUs of its own when trials share the machine."""
    logger = get_run_logger()

    def prune(epoch: int, accuracy: float) -> bool:
        if trial is None:
            return False
        trial.report(accuracy, epoch)
        return epoch < run.epochs and trial.should_prune()  # the last epoch is the result: nothing left to save

    result = TrialResult(number=number, name=name, values=values, seed=seed)
    if run.remote is not None and trial is not None:
        return dispatch(run.remote, trial, result, run.commit, run.epochs, run.parent, env[run_record.TRIAL_ENV],
                        run.repo, logger.info)  # fmt: skip
    with contextlib.ExitStack() as held:
        if trial is not None:  # a study in a database: the trial beats while it runs (flows/sweep/storage.py)
            held.enter_context(beating(trial.study._storage, trial._trial_id))
        cores = held.enter_context(cpus.claimed(run.runs, want_cpus, logger.info)) if want_cpus else None
        run_trial(run.repo, run.workdir, result, commit=run.commit, env=env, report=prune, log=logger.info,
                  extra_sets=run.extra, cores=cores, store=run.store)  # fmt: skip
    if trial is not None and result.restored:  # its epochs, for the pruner's medians, from the restored history
        for epoch, accuracy in enumerate(result.epochs, start=1):
            trial.report(accuracy, epoch)
    return result


def run_study(study: optuna.Study, run: Run) -> list[TrialResult]:
    """Trials until the study has sweep.trials finished or pruned ones; returns the ones this sweep ran."""
    sweep = run.sweep
    logger = get_run_logger()
    running: dict[int, tuple[optuna.Trial, Any]] = {}
    results: list[TrialResult] = []
    failures = 0  # in a row: a failed trial is replaced, but not forever
    # Over machines, in a row on every worker: one whose clone lacks the DVC remote fails each trial it takes,
    # while the others run theirs (a worker not heard from yet does not count)
    streaks: dict[str, int] = {}
    checked = time.monotonic()
    while counted(study) + len(running) < sweep.trials or running:
        if sweep.storage and time.monotonic() - checked >= sweep.heartbeat_s:
            checked = time.monotonic()
            stale = fail_stale(study)  # trials whose machine went silent: failed, their values queued again
            if stale:
                logger.warning("trials %s stopped beating (their machine or worker died): failed, retried", stale)
        while (len(running) < sweep.parallel and counted(study) + len(running) < sweep.trials
               and failures < MAX_FAILURES_IN_A_ROW):  # fmt: skip
            trial = study.ask()
            values = suggest(trial, sweep.space)
            retried = retry_of(study, trial.number) if sweep.storage else None  # its copy has the dead one's name
            name = f"{sweep.study}-t{trial.number:03d}" if retried is not None else trial_name(sweep.study, trial)
            trial.set_user_attr("name", name)
            logger.info("trial %s: %s", name, values)
            future = run.submit(name, trial.number, values, None, f"{sweep.study}:{trial.number}", trial, pinned=True)
            running[trial.number] = (trial, future)
        done = [n for n, (_, f) in running.items() if f.wrapped_future.done()]  # local threads: no API polling
        if not running:  # nothing asked: the trials keep failing
            raise TrialsFailing(f"{failures} trials in a row failed; the last: {results[-1].message}")
        if not done:
            time.sleep(1.0)
            continue
        for number in done:
            trial, future = running.pop(number)
            result: TrialResult = future.result()
            results.append(result)
            _tell(study, trial, result)
            if result.state != "complete" and run.track:
                report.log_unfinished(run.store, run.experiment, run.parent, sweep.study, result)
            logger.info(
                "trial %s %s in %.0f s: %s",
                result.name,
                result.state,
                result.seconds,
                result.message.splitlines()[0] if result.message else "",
            )
            streaks[result.where] = streaks.get(result.where, 0) + 1 if result.state == "failed" else 0
            failures = min(streaks.values())
            if result.state == "failed":
                logger.warning("trial %s failed:\n%s", result.name, result.message)
    return results


def _tell(study: optuna.Study, trial: optuna.Trial, result: TrialResult) -> None:
    frozen = next(t for t in study.get_trials(deepcopy=False) if t.number == trial.number)
    if frozen.state.is_finished():  # failed by the heartbeat check while it ran: its retry is queued
        return
    attrs = {"test_accuracy": result.test_accuracy, "verdict": result.verdict, "seconds": result.seconds}
    for key, value in attrs.items():
        if value is not None:
            trial.set_user_attr(key, value)
    if result.state == "complete":
        study.tell(trial, result.val_accuracy)
    elif result.state == "pruned":
        study.tell(trial, state=TrialState.PRUNED)
    else:
        study.tell(trial, state=TrialState.FAIL)
