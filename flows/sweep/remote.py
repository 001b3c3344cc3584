"""A sweep over machines, the study's side: with `sweep.pool` set, each trial is a flow run of deployment
sweep-trial/<pool> (prefect.yaml) on a worker of that pool, in that machine's clone (flows/sweep/worker.py).

The machines share a git remote, a DVC remote, the study's database (`sweep.storage`) and, when
MLFLOW_TRACKING_URI names a tracking server, MLflow. Placement's mechanisms carry it (flows/placement/):

  the study (this machine)                          a worker (its own clone)
  refuse: no DVC remote, commit not on the git remote
  dvc push (the committed run's outputs)  -DVC->   git fetch; a copy of the commit; dvc pull in it
  study.ask(); run_deployment(number)              the trial's values from the database; dvc exp run,
    wait, watching the trial's heartbeat             reporting each epoch there (the pruner decides there);
                                                     its heartbeat every sweep.heartbeat_s
                                          <-git/DVC- dvc exp push <git remote> <trial>; result as a user attr
  dvc exp pull <git remote> <trial>; study.tell()

A worker whose machine dies stops beating: the study fails the trial (flows/sweep/storage.py), cancels its
flow run and asks for its values again. Seed reruns (sweep.seeds > 1) run on this machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound

from flows.placement import PlacementError
from flows.placement.git import on_remote_branch
from flows.placement.protocol import dvc_move
from flows.placement.send import check_remotes, warn_if_nobody_serves
from flows.shell import stream
from flows.stage import dvc_command
from flows.sweep.trial import TrialResult

DEPLOYMENT = "sweep-trial/{pool}"  # prefect.yaml: the trials of a sweep with sweep.pool set
RESULT = "result"  # the worker's TrialResult, as a user attr of its Optuna trial
POLL_S = 3.0


@dataclass(frozen=True)
class Remote:
    """How this sweep reaches its workers."""

    pool: str
    git_remote: str
    dvc_remote: str | None
    tracking_uri: str | None  # a tracking server the workers log to; None: each worker's own store

    @property
    def deployment(self) -> str:
        return DEPLOYMENT.format(pool=self.pool)


def prepare(repo: Path, commit: str, pool: str, git_remote: str, dvc_remote: str | None, uri: str, log: Any) -> Remote:
    """Before any trial: the remotes are this checkout's, the commit is on the git remote, the committed run's
    outputs are on the DVC remote (pushed), and the deployment exists."""
    check_remotes(repo, git_remote, dvc_remote, f"sweep.pool {pool!r} needs a DVC remote every machine reaches: "
                  "`dvc remote add -d storage <url>`, committed")  # fmt: skip
    if not on_remote_branch(repo, commit, git_remote):
        raise PlacementError(f"commit {commit[:12]} is on no branch of git remote {git_remote!r}: `git push` it first; "
                             f"the {pool} machine checks it out from there")  # fmt: skip
    _deployment_exists(DEPLOYMENT.format(pool=pool))
    warn_if_nobody_serves(pool)  # trials wait for a worker; the warning says how to start one
    dvc_move(repo, "push", remote=dvc_remote, log=log)
    server = uri if uri.startswith(("http://", "https://")) else None
    if server is None:
        log(f"MLflow is {uri} on this machine: each worker's trials log to that worker's own store "
            "(MLFLOW_TRACKING_URI=http://<tracking server> gathers them)")  # fmt: skip
    return Remote(pool, git_remote, dvc_remote, server)


def _deployment_exists(name: str) -> None:
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            client.read_deployment_by_name(name)
    except ObjectNotFound:
        raise PlacementError(
            f"sweep.pool is {name.split('/')[1]!r}, but there is no deployment {name}: add one to prefect.yaml (like "
            f"{DEPLOYMENT.format(pool='trials')}) and `make prefect-deploy`"
        ) from None


def dispatch(remote: Remote, trial: optuna.Trial, result: TrialResult, commit: str, epochs: int,
             parent: str | None, tag: str, repo: Path, log: Any) -> TrialResult:  # fmt: skip
    """Run the trial on a worker of the pool and fill in `result`; a trial whose worker stopped beating is
    failed (the study retries its values) and its flow run cancelled."""
    started = time.monotonic()
    parameters = {"study": trial.study.study_name, "number": trial.number, "commit": commit, "epochs": epochs,
                  "parent": parent, "tag": tag, "git_remote": remote.git_remote, "dvc_remote": remote.dvc_remote,
                  "tracking_uri": remote.tracking_uri}  # fmt: skip
    child = run_deployment(remote.deployment, parameters=parameters, timeout=0, as_subflow=True)
    log(f"trial {result.name}: flow run {child.name} of {remote.deployment}")
    state = _wait(child.id, trial)
    frozen = next(t for t in trial.study.get_trials(deepcopy=False) if t.number == trial.number)
    if frozen.state == optuna.trial.TrialState.FAIL:  # failed by the heartbeat check: its machine went silent
        _cancel(child.id)
        result.state = "failed"
        result.message = f"its worker stopped beating (flow run {child.name}): failed; its values run again"
    elif RESULT in frozen.user_attrs:
        for key, value in frozen.user_attrs[RESULT].items():
            setattr(result, key, value)
    else:
        result.state = "failed"
        said = f"{state.name}: {state.message or ''}" if state is not None else "unknown"
        result.message = f"flow run {child.name} of {remote.deployment} ended {said} (its log has the details)"
    if result.state == "complete":
        where = ["--remote", remote.dvc_remote] if remote.dvc_remote else []
        pulled = stream(dvc_command("exp", "pull", *where, remote.git_remote, result.name), cwd=repo, log=log)
        if pulled.returncode != 0:
            result.state = "failed"
            result.message = f"`dvc exp pull {remote.git_remote} {result.name}` failed:\n{pulled.tail}"
    result.seconds = round(time.monotonic() - started, 1)
    return result


def _wait(run_id: Any, trial: optuna.Trial) -> Any:
    """The flow run's final state; stops early when the trial is no longer running in the study."""
    from prefect.client.orchestration import get_client

    while True:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(run_id).state
        if state is not None and state.is_final():
            return state
        frozen = next(t for t in trial.study.get_trials(deepcopy=False) if t.number == trial.number)
        if frozen.state.is_finished():
            return state
        time.sleep(POLL_S)


def _cancel(run_id: Any) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    try:
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(run_id, Cancelled(message="its worker stopped beating"), force=True)
    except Exception:  # noqa: BLE001 - the study goes on; the run's own crash detection closes it otherwise
        pass
