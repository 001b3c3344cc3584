"""sweep-flow (`make sweep [TRIALS=n] [PARALLEL=k] [STUDY=name]`): an Optuna study over params.yaml's `sweep.space`.

Each trial is a DVC experiment, `dvc exp run -n <study>-t<number> -S key=value ...`, run by a Prefect task in its
own temporary copy of this repository at HEAD (flows/sweep/trial.py), at most `parallel` at once (the flow's
task runner); with `sweep.pool` set, on that Prefect pool's workers, each in its machine's clone
(flows/sweep/remote.py and worker.py). A trial reports each epoch's validation accuracy; the pruner
(flows/sweep/study.py) may stop it there. The study lives in Optuna's journal under runs/sweep/ (or in
`sweep.storage`'s database: flows/sweep/storage.py), so the same command resumes a killed sweep: the
finished and pruned trials are kept, the ones that were running are retried. `sweep.trials` is the study's size,
counted in finished and pruned trials.

At the end it prints the best trial with its `dvc exp apply` line, writes the comparison (a table with each
trial's values, epochs and accuracies; with `sweep.seeds` > 1, the best `rerun_top` configurations rerun with
other seeds, and a gap smaller than the seed spread is marked "within noise"), a plot of each searched value
against validation accuracy, a Prefect artifact of both, and one MLflow parent run with the trials as children.

This module is the flow and `make sweep`'s command line (refusals before any trial: the space, the study's
lock, a paths.checkpoints the trials would share). The parts: flows/sweep/scheduler.py (trials as Prefect
tasks), seeds.py (seed reruns), outcome.py (the comparison), trial.py (one trial in its copy), cpus.py
(CPUs per trial), store.py (the MLflow store), study.py, space.py, report.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import yaml
from prefect import flow, get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from flows.placement import PlacementError
from flows.scratch import checkpoints_outside
from flows.sweep import cpus, report
from flows.sweep.outcome import conclude
from flows.sweep.remote import prepare
from flows.sweep.scheduler import Run, TrialsFailing, run_study
from flows.sweep.seeds import rerun_seeds, seeds_path
from flows.sweep.space import SpaceError, check_space
from flows.sweep.storage import StorageUnreachable, masked, open_storage
from flows.sweep.store import Store
from flows.sweep.study import SweepBusy, journal_path, open_study, resume, study_lock, study_uid
from flows.sweep.trial import clear_leftovers, stop_all, trial_env
from tasks.core.experiment_params import SweepParams
from tasks.core.git import changed_files, git_output, head_commit
from tasks.core.io import read_json
from tasks.core.params import PARAMS_FILE, ParamsError, load_params
from tasks.release import tracking


class SharedCheckpoints(ValueError):
    """paths.checkpoints lies outside the trials' checkouts: one line naming it."""


def committed_params(repo: Path, commit: str) -> dict[str, Any]:
    """params.yaml at `commit`: what the trials run (the workspace's may hold uncommitted changes)."""
    return yaml.safe_load(git_output(repo, "show", f"{commit}:{PARAMS_FILE.as_posix()}") or "") or {}


def refuse_shared_checkpoints(repo: Path, commit: str) -> None:
    """Trials are checkouts of `commit`: a paths.checkpoints outside a checkout is one folder for all of them
    (and the workspace), where a finished trial's pruning of old runs could delete a running trial's folder."""
    committed = committed_params(repo, commit)
    runs = repo / str((committed.get("paths") or {}).get("runs", "runs"))
    folder = checkpoints_outside(committed, runs / "sweep" / "study" / "trial" / "repo")  # where a checkout lies
    if folder is not None:
        raise SharedCheckpoints(
            f"paths.checkpoints is {folder} in params.yaml at {commit[:12]}, outside the trials' checkouts: every "
            "trial would train in that one folder, and a finished trial's pruning (train.keep_checkpoint_runs) "
            "could delete a running trial's checkpoints; set paths.checkpoints inside the project (the default, "
            "runs/checkpoints) and commit it"
        )


def refuse_uncommitted_storage(repo: Path, commit: str, storage: str) -> None:
    """Workers read sweep.storage from the commit's params.yaml: the workspace's must be the same."""
    committed = str((committed_params(repo, commit).get("sweep") or {}).get("storage") or "")
    if committed != storage:
        raise PlacementError(
            f"sweep.storage is {masked(storage)} here but {masked(committed) or 'empty'} in params.yaml at "
            f"{commit[:12]}, which the workers read: commit and push params.yaml"
        )


def _epochs(history: Path) -> int:
    """How many epochs the last run trained (its train_history.json): the pruner's schedule."""
    try:
        return len(read_json(history)) or 1
    except (OSError, ValueError):
        return 1


@flow(name="sweep-flow", log_prints=True)
def sweep_flow(trials: int | None = None, parallel: int | None = None, study_name: str | None = None,
               git_remote: str = "origin", dvc_remote: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Run the study to `trials` finished or pruned trials, `parallel` at once; print and publish the comparison.
    With sweep.pool set, the trials run on that pool's workers, reached through `git_remote` and `dvc_remote`."""
    logger = get_run_logger()
    repo = Path.cwd()
    params = load_params(repo / PARAMS_FILE)
    update = {k: v for k, v in (("trials", trials), ("parallel", parallel), ("study", study_name)) if v is not None}
    sweep = SweepParams.model_validate({**params.sweep.model_dump(), **update})  # a deployment's values checked too
    check_space(yaml.safe_load((repo / PARAMS_FILE).read_text()) or {}, sweep.space)  # before any trial
    commit = head_commit(repo)
    if commit is None:
        raise RuntimeError(f"{repo} has no git commit: trials are clones of HEAD, so commit the project first")
    refuse_shared_checkpoints(repo, commit)
    if changed_files(repo, "params.yaml", "tasks", "dvc.yaml"):
        logger.warning(
            "trials start from the commit %s: uncommitted changes to params.yaml, dvc.yaml or tasks/ "
            "are not in them (commit them first to search from them)",
            commit[:12],
        )
    runs = repo / params.paths.runs
    epochs = _epochs(repo / params.paths.train_history)
    store = Store(tracking.tracking_uri(tracking.project_root(repo)))
    workdir = runs / "sweep" / sweep.study
    with study_lock(runs, sweep.study):
        leftovers = clear_leftovers(workdir)
        if leftovers:
            logger.info("removed %d trial copies a killed sweep left in %s", len(leftovers), workdir)
        study = open_study(runs, sweep, epochs)
        remote = None
        if sweep.pool:  # before any trial: the remotes, the commit there, the inputs pushed (flows/sweep/remote.py)
            refuse_uncommitted_storage(repo, commit, sweep.storage)
            remote = prepare(repo, commit, sweep.pool, git_remote, dvc_remote, store.uri, logger.info)
        retried = resume(study)
        if retried:
            logger.info(
                "resuming study %s: trials %s were running when it stopped; their values run again",
                sweep.study,
                retried,
            )
        # The sweep's own MLflow calls fail in seconds on an unreachable server, as the gate's do (mlflow_store)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        uid = study_uid(study)
        parent = (
            None
            if not params.tracking.enabled
            else report.parent_run(store, params.tracking.experiment, sweep.study, uid, journal_path(runs, sweep.study))
        )
        # Trials sharing the machine run on CPUs of their own (flows/sweep/cpus.py), so train.threads 0 counts its
        # own and the experiment that `dvc exp apply` brings back holds only the searched values; without CPU
        # affinity (macOS), threads.
        here = sweep.parallel > 1 and not remote
        share = cpus.share(sweep.parallel) if here else None
        cores = os.cpu_count() or 1
        extra = ["-S", f"train.threads={max(1, cores // sweep.parallel)}"] if here and not share else []
        seed = int(committed_params(repo, commit).get("seed", params.seed))  # the trials' seed, as committed
        run = Run(sweep, repo, runs, commit, epochs, trial_env(store.uri, parent, sweep.study), extra, store,
                  params.tracking.experiment, parent, seed, share, params.tracking.enabled, remote)  # fmt: skip
        try:
            results = run_study(study, run)
            reruns = rerun_seeds(study, sweep, seed, seeds_path(runs, sweep.study), uid, run.rerun, logger)
        except BaseException:  # Ctrl-C, or the flow failing: no trial outlives the sweep
            stopped = stop_all()
            if stopped:
                logger.warning("stopped %d running trials; the same command retries them", stopped)
            raise
        return conclude(study, run, results, reruns, logger)


def _positive(name: str, text: str | None) -> int | None:
    if text is None or text == "":
        return None
    if not text.isdigit() or int(text) < 1:
        print(f"error: {name}={text} is not a positive integer: make sweep {name}=3", file=sys.stderr)
        sys.exit(2)
    return int(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", help="the study's size in finished or pruned trials (default sweep.trials)")
    parser.add_argument("--parallel", help="trials at once (default sweep.parallel)")
    parser.add_argument("--study", help="the study's name (default sweep.study)")
    args = parser.parse_args(argv)
    trials, parallel = _positive("TRIALS", args.trials), _positive("PARALLEL", args.parallel)
    try:
        params = load_params(PARAMS_FILE)
        check_space(yaml.safe_load(PARAMS_FILE.read_text()) or {}, params.sweep.space)
        commit = head_commit(Path.cwd())
        if commit is not None:  # none: sweep_flow says so
            refuse_shared_checkpoints(Path.cwd(), commit)
        with study_lock(params.paths.runs, args.study or params.sweep.study):
            pass  # a sweep of this study already running is refused here, in one line, before Prefect starts
        if params.sweep.storage:  # an unreachable database, too
            open_storage(params.sweep.storage, Path(), params.sweep.heartbeat_s)
        k = parallel or params.sweep.parallel
        sweep_flow.with_options(task_runner=ThreadPoolTaskRunner(max_workers=k))(trials, parallel, args.study)
    except (SpaceError, ParamsError, SweepBusy, SharedCheckpoints, StorageUnreachable, PlacementError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except TrialsFailing as exc:
        print(f"error: sweep stopped: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
