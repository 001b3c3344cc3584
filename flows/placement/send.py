"""Placement, the sending side: one stage of dvc.yaml on another machine, through a Prefect work pool of its own.

train-flow's `placement` parameter (prefect.yaml) maps a stage to a work pool, say {train: gpu}. That
stage then runs as a flow run of deployment `run-stage/<pool>`, a subflow of the train-flow run (the
UI shows it under the stage's task), on a worker of that pool, in the worker's own checkout. The two
machines share only a git remote and a DVC remote; dvc.yaml stays the one DAG:

  train-flow (this machine)                       run-stage (the pool's machine, its own checkout)
  dvc push <the stage's upstream stages>  -DVC->  git fetch; check out train-flow's commit;
    (and the .dvc files in its dep folders: train's models/pretrained)
  send: the commit, dvc.lock, params.yaml           write dvc.lock and params.yaml as sent
                                                  dvc pull <upstream stages> (and those .dvc files)
                                                  dvc repro --single-item <stage>   (DVC decides)
                                                  dvc push <stage>
  git fetch refs/imagepipe/stages/<run id> <-git- a commit of dvc.lock + the stage's `cache: false` outputs
  take the stage's dvc.lock entry and those files, `dvc pull <stage>`: dvc.lock as one machine writes it

When the stage is up to date here (DVC's status names no change), nothing is sent. A run-stage run that
ends Crashed (its machine, worker or flow process died: the heartbeat automation says so) ends the
train-flow run Crashed too, without a retry that would wait for a worker that is gone; retrying the
train-flow run then resumes the stage from its checkpoint on that machine.

This module is train-flow's side: the placed-stage task that sends the stage and takes it back.
flows/placement/receive.py is the pool's side; flows/placement/protocol.py what both know.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from prefect import get_run_logger, task
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound

from flows.explain import why_stage_runs
from flows.placement.git import (
    changed_by_hand,
    check_git_remote,
    dvc_files_in_deps,
    git,
    git_bytes,
    inputs_to_send,
    on_remote_branch,
    tracked_files,
)  # fmt: skip
from flows.placement.protocol import (
    DEPLOYMENT,
    REFS,
    SENT,
    PlacementError,
    StageCancelled,
    StageCrashed,
    check_commit,
    check_dvc_remote,
    dvc_move,
    environment_files,
    read_result,
)  # fmt: skip
from flows.stage import StageFailed
from tasks.core.dag import Stage, load_stages
from tasks.core.io import atomic_file
from tasks.core.private_api import dvc_locked, dvc_remotes, edit_yaml


def _folder_travels(repo: Path, dep: str, tracked: set[str], dvc_files: list[str]) -> bool:
    """Every file of the folder is a file of the commit or one its .dvc files track."""
    if not (repo / dep).is_dir():
        return False
    carried = tracked | {path.removesuffix(".dvc") for path in dvc_files}
    return all(str(path.relative_to(repo)) in carried for path in (repo / dep).rglob("*") if path.is_file())


def _check_inputs(repo: Path, stage: str, stages: dict[str, Stage]) -> None:
    """What reaches the other machine: the commit's files (git), the cached outputs of upstream stages and the
    files the commit's .dvc files track in a dependency folder (the DVC remote). A stage that reads anything
    else (an uncached output such as reports/export.json, a folder with files of neither kind) cannot be
    placed yet: refuse rather than run on stale copies."""
    cached = {path for up in stages[stage].upstream for path in set(stages[up].outs) - set(stages[up].uncached)}
    cached |= set(environment_files(stage, stages))  # written on the other machine, for that machine
    tracked = tracked_files(repo, stages)
    dvc_files = dvc_files_in_deps(repo, stage, stages)
    for dep in stages[stage].deps:
        if dep not in tracked and dep not in cached and not _folder_travels(repo, dep, tracked, dvc_files):
            raise PlacementError(
                f"{stage} cannot be placed: it reads {dep}, which is neither a file of the commit nor a cached "
                "output of an upstream stage, so it would not reach the other machine"
            )


def _commit_on_remote(repo: Path, git_remote: str, pool: str) -> str:
    commit = git(repo, "rev-parse", "HEAD")
    stages = load_stages(repo)
    unsent = changed_by_hand(repo, stages)
    if unsent:
        raise PlacementError(
            f"uncommitted changes to {', '.join(unsent[:5])}: the {pool} machine runs commit {commit[:12]}, "
            "so commit and `git push` them first"
        )
    if not on_remote_branch(repo, commit, git_remote):
        raise PlacementError(
            f"commit {commit[:12]} is on no branch of git remote {git_remote!r}: `git push` it first; "
            f"the {pool} machine checks it out from there"
        )
    return commit


def check_remotes(repo: Path, git_remote: str, dvc_remote: str | None, missing: str) -> None:
    """The git and DVC remotes named are this checkout's, and it has a default DVC remote (else PlacementError
    `missing`): what moving work to another machine needs, a placed stage or a sweep's trials."""
    check_git_remote(repo, git_remote)
    check_dvc_remote(repo, dvc_remote)
    if not dvc_remotes(repo)[0]:
        raise PlacementError(missing)


def warn_if_nobody_serves(pool: str) -> None:
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            workers = client.read_workers_for_work_pool(pool)
    except Exception as exc:  # only a hint; the run itself says what is wrong
        if isinstance(exc, ObjectNotFound) or getattr(getattr(exc, "response", None), "status_code", None) == 404:
            raise PlacementError(
                f"work pool {pool!r} does not exist: `prefect work-pool create {pool} --type process`"
            ) from None
        return
    if not any(worker.status == "ONLINE" for worker in workers):
        get_run_logger().warning(
            "no worker of pool %r is online: the stage waits until one starts "
            "(on that machine, in its checkout: `make prefect-worker POOL=%s`)", pool, pool,
        )  # fmt: skip


def _not_crashed(task: Any, task_run: Any, state: Any) -> bool:
    """Retry a placed stage that failed, not one whose machine died: a new run would wait for a worker
    that is gone, and the train-flow run would stay Running instead of saying Crashed."""
    return not isinstance(state.result(raise_on_failure=False), StageCrashed | StageCancelled)


@task(name="dvc-stage-placed", task_run_name="{stage}", cache_policy=None, retry_condition_fn=_not_crashed)
def placed_stage(
    stage: str, pool: str, repo_dir: str, git_remote: str = "origin", dvc_remote: str | None = None
) -> dict[str, Any]:
    """Run `stage` on a worker of `pool` (deployment run-stage/<pool>) and take its outputs back here.
    Returns what run_stage returns, plus where it ran."""
    logger = get_run_logger()
    repo = Path(repo_dir)
    try:
        why = why_stage_runs(repo, stage)
    except (RuntimeError, OSError, ValueError) as exc:
        why = [f"(DVC status unavailable: {exc})"]
    if not why:
        logger.info("why %s: nothing changed, DVC would skip it; not sent to pool %s", stage, pool)
        return {"outcome": "unchanged", "why": [], "pool": pool}
    logger.info("why %s: %s; sending it to pool %s", stage, "; ".join(why), pool)
    stages = load_stages(repo)
    check_remotes(repo, git_remote, dvc_remote, f"placing {stage} on pool {pool} needs a DVC remote that both "
                  "machines reach: `dvc remote add -d storage <url>`, committed in .dvc/config")  # fmt: skip
    _check_inputs(repo, stage, stages)
    commit = _commit_on_remote(repo, git_remote, pool)
    inputs = inputs_to_send(repo, stage, stages)
    if inputs:  # for the other machine's `dvc pull`
        dvc_move(repo, "push", *inputs, remote=dvc_remote, log=logger.info)
    with dvc_locked(repo):  # a stage running here may be writing dvc.lock right now
        files = {name: (repo / name).read_text() for name in SENT if (repo / name).is_file()}
    deployment = DEPLOYMENT.format(pool=pool)
    warn_if_nobody_serves(pool)
    try:
        child = run_deployment(
            deployment, timeout=None, as_subflow=True,
            parameters={"stage": stage, "commit": commit, "files": files, "git_remote": git_remote,
                        "dvc_remote": dvc_remote},
        )  # fmt: skip
    except ObjectNotFound:
        raise PlacementError(
            f"placement puts {stage} on pool {pool}, but there is no deployment {deployment}: add one to "
            "prefect.yaml (like run-stage/gpu) and `make prefect-deploy`"
        ) from None
    state = child.state
    where = f"{stage} on pool {pool} (flow run {child.name} of {deployment})"
    if state is not None and state.is_crashed():
        raise StageCrashed(
            f"{where} crashed: {state.message or 'its process died'}. Retry this train-flow run once a worker of "
            f"pool {pool} runs again: the stage resumes from its checkpoint on that machine"
        )
    if state is not None and state.is_cancelled():
        raise StageCancelled(f"{where} was cancelled: {state.message or ''}")
    if state is None or not state.is_completed():
        name = state.name if state else "unknown"
        raise StageFailed(f"{where} ended {name}: {state.message if state else ''} (its log has the details)")
    return {**take_back(repo, stage, stages, child.id, git_remote, dvc_remote), "pool": pool}


def take_back(
    repo: Path, stage: str, stages: dict[str, Stage], run_id: Any, git_remote: str, dvc_remote: str | None
) -> dict[str, Any]:
    """The placed run's dvc.lock entry and uncached outputs from its git ref, its cached outputs from
    the DVC remote: afterwards this checkout is as if the stage had run here (with the other machine's
    environment record, which this machine's next environment stage replaces)."""
    logger = get_run_logger()
    spec = stages[stage]
    ref = f"{REFS}/{run_id}"
    git(repo, "fetch", "--quiet", "--", git_remote, f"+{ref}:{ref}")  # its own ref: FETCH_HEAD is shared by fetches
    sha = check_commit(git(repo, "rev-parse", "--verify", "--end-of-options", ref))
    message = git(repo, "log", "-1", "--format=%B", sha)
    result = read_result(message)
    entry = yaml.safe_load(git_bytes(repo, "show", f"{sha}:dvc.lock"))["stages"][stage]
    for path in [*spec.uncached, *environment_files(stage, stages)]:
        with atomic_file(repo / path) as handle:
            handle.write(git_bytes(repo, "show", f"{sha}:{path}"))
    with dvc_locked(repo), edit_yaml(repo / "dvc.lock") as lock:  # DVC's round trip, as Lockfile.dump
        lock.setdefault("schema", "2.0")
        lock.setdefault("stages", {})[stage] = entry
    dvc_move(repo, "pull", stage, remote=dvc_remote, log=logger.info)
    for path in sorted(set(spec.outs) - set(spec.uncached)):
        _ignore(repo, path)
    try:
        git(repo, "push", "--quiet", "--", git_remote, f":{ref}")  # taken: the ref has done its job
        git(repo, "update-ref", "-d", ref)
    except PlacementError as exc:
        logger.warning("could not delete %s: %s", ref, exc)
    logger.info("%s: %s on %s; dvc.lock entry, %d uncached output(s) and the cached ones taken back",
                stage, result["outcome"], result["host"], len(spec.uncached))  # fmt: skip
    return {"outcome": result["outcome"], "why": result["why"], "host": result["host"]}


def _ignore(repo: Path, path: str) -> None:
    """The line DVC's own run would have added to the .gitignore beside a cached output (`dvc pull`
    does not), so git never sees models/model.pt as a file to add."""
    gitignore = repo / Path(path).parent / ".gitignore"
    entry = f"/{Path(path).name}"
    lines = gitignore.read_text().splitlines() if gitignore.is_file() else []
    if entry not in lines:
        gitignore.write_text("".join(f"{line}\n" for line in [*lines, entry]))
