"""A sweep over machines, a worker's side: the sweep-trial flow (prefect.yaml's sweep-trial/<pool>), in the clone
that the pool's worker on this machine runs in (IMAGEPIPE_CHECKOUT, `make prefect-worker POOL=<pool> LIMIT=1`).

It checks its parameters before git, DVC or the database sees them, fetches the commit from the git remote,
reads the study's database URL from that commit's params.yaml (its password from this machine's ~/.pgpass or
PGPASSWORD: it never travels as a parameter), takes the trial's values from the study (never from a parameter)
and runs the trial as flows/sweep/trial.py does on one machine, in a copy of the commit whose inputs come from
the DVC remote. It beats while it runs, reports each epoch to the study (the pruner decides here), pushes the
finished trial's experiment (`dvc exp push <git remote> <trial>`) and leaves its result as a user attr of the
trial, which the study's side (flows/sweep/remote.py) reads when the flow run ends.
"""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path
from typing import Any

import optuna
import yaml
from prefect import flow, get_run_logger

from flows.placement import PlacementError, check_dvc_remote, check_git_remote
from flows.placement.git import git, on_remote_branch
from flows.placement.protocol import check_commit
from flows.shell import refuse_overriding_env, stream
from flows.stage import dvc_command
from flows.sweep.remote import RESULT
from flows.sweep.storage import beating, open_storage
from flows.sweep.store import Store
from flows.sweep.study import pruner, trial_name
from flows.sweep.trial import TrialResult, run_trial, trial_env
from tasks.core.experiment_params import SweepParams
from tasks.core.params import PARAMS_FILE
from tasks.release import tracking


def _committed_sweep(repo: Path, commit: str) -> SweepParams:
    raw = yaml.safe_load(git(repo, "show", f"{commit}:{PARAMS_FILE.as_posix()}")) or {}
    sweep = SweepParams.model_validate(raw.get("sweep") or {})
    if not sweep.storage:
        raise ValueError(f"params.yaml at {commit[:12]} has no sweep.storage: a trial on another machine "
                             "reports to the study's database")  # fmt: skip
    return sweep


@flow(name="sweep-trial", log_prints=True, validate_parameters=True)
def sweep_trial_flow(
    study: str,
    number: int,
    commit: str,
    epochs: int,
    tag: str,
    parent: str | None = None,
    git_remote: str = "origin",
    dvc_remote: str | None = None,
    tracking_uri: str | None = None,
) -> dict[str, Any]:
    """Trial `number` of `study` in this machine's clone (started by a sweep with sweep.pool set, not by hand)."""
    refuse_overriding_env("sweep-trial")
    logger = get_run_logger()
    repo = Path.cwd()
    check_commit(commit)
    check_git_remote(repo, git_remote)
    check_dvc_remote(repo, dvc_remote)
    if tracking_uri is not None and not tracking_uri.startswith(("http://", "https://")):
        raise ValueError(f"tracking_uri {tracking_uri!r} is not a tracking server's http(s) URL")
    if not on_remote_branch(repo, commit, git_remote):
        raise PlacementError(f"commit {commit[:12]} is on no branch of git remote {git_remote!r} (fetched into {repo})")
    sweep = _committed_sweep(repo, commit)
    storage = open_storage(sweep.storage, Path(), sweep.heartbeat_s)
    found = optuna.load_study(study_name=study, storage=storage, pruner=pruner(sweep, epochs))
    frozen = next((t for t in found.get_trials(deepcopy=False) if t.number == number), None)
    if frozen is None or frozen.state != optuna.trial.TrialState.RUNNING:
        raise ValueError(f"study {study!r} has no running trial {number}")
    unknown = sorted(set(frozen.params) - set(sweep.space))
    if unknown:
        raise ValueError(f"trial {number} sets {', '.join(unknown)}, not in the commit's sweep.space")
    trial = optuna.Trial(found, frozen._trial_id)  # the running trial itself (Optuna's ask/tell has no public way)
    name = trial_name(study, frozen)
    result = TrialResult(number=number, name=name, values=dict(frozen.params), seed=None)

    def prune(epoch: int, accuracy: float) -> bool:
        trial.report(accuracy, epoch)
        return epoch < epochs and trial.should_prune()

    own = Store(tracking.tracking_uri(repo)) if tracking_uri is None else Store(tracking_uri)
    env = trial_env(tracking_uri, parent if tracking_uri else None, tag)
    with beating(storage, frozen._trial_id):
        run_trial(repo, repo / "runs" / "sweep" / study, result, commit=commit, env=env, report=prune,
                  log=logger.info, store=own, pull=True, dvc_remote=dvc_remote)  # fmt: skip
        if result.state == "complete":
            where = ["--remote", dvc_remote] if dvc_remote else []
            pushed = stream(dvc_command("exp", "push", *where, git_remote, name), cwd=repo, log=logger.info)
            if pushed.returncode != 0:
                result.state, result.message = "failed", f"`dvc exp push {git_remote} {name}` failed:\n{pushed.tail}"
    if result.restored:  # its epochs, for the pruner's medians, from the restored history
        for epoch, accuracy in enumerate(result.epochs, start=1):
            trial.report(accuracy, epoch)
    result.where = f"{socket.gethostname()}:{repo}"
    kept = {k: v for k, v in dataclasses.asdict(result).items() if k not in ("number", "name", "values", "seed")}
    trial.set_user_attr("checkout", result.where)
    trial.set_user_attr(RESULT, kept)
    logger.info("trial %s %s: %s", name, result.state, result.message.splitlines()[0] if result.message else "")
    return {"name": name, **kept}
