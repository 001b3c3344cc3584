"""Placement, the receiving side: the run-stage flow, on a worker of the pool a stage is placed on.

It checks every parameter before git or DVC sees it, checks out the sent commit in the worker's own
checkout, writes the sent dvc.lock and params.yaml, runs the environment stage for this machine, pulls
the stage's inputs, runs the stage through DVC, pushes its outputs and leaves its dvc.lock entry and
uncached outputs as a commit at refs/imagepipe/stages/<run id> (flows/placement/protocol.py), which
the sending side takes back (flows/placement/send.py).
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, runtime

from flows.artifacts import stage_reports
from flows.placement.git import changed_by_hand, check_git_remote, git, has_config, inputs_to_send, on_remote_branch
from flows.placement.protocol import (
    ENVIRONMENT,
    REFS,
    PlacementError,
    check_commit,
    check_dvc_remote,
    check_files,
    check_sent_params,
    dvc_move,
    environment_files,
    result_message,
)  # fmt: skip
from flows.shell import refuse_overriding_env
from flows.stage import run_stage
from tasks.core.dag import Stage, load_stages
from tasks.core.io import atomic_file
from tasks.core.params import PARAMS_FILE, load_params


def _check_out(repo: Path, commit: str, git_remote: str) -> None:
    """This worker's checkout at `commit`. What earlier runs wrote goes; anything else changed stops it."""
    mine = changed_by_hand(repo, load_stages(repo))
    if mine:
        raise PlacementError(
            f"the checkout {repo} has local changes to {', '.join(mine[:5])}: it belongs to the worker of this "
            "pool, which checks out each run's commit; commit or move them away"
        )
    if not on_remote_branch(repo, commit, git_remote):
        raise PlacementError(f"commit {commit[:12]} is on no branch of git remote {git_remote!r} (fetched into {repo})")
    git(repo, "checkout", "--quiet", "--force", "--detach", commit, "--")


def _ship(repo: Path, stage: str, stages: dict[str, Stage], ref: str, git_remote: str, result: dict[str, Any]) -> str:
    """A commit of dvc.lock and the stage's uncached outputs on top of the run's commit, pushed to `ref`,
    made with a temporary index: this checkout's HEAD, index and branches stay as they are."""
    spec = stages[stage]
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        if not has_config(repo, "user.email"):  # a worker's clone may have no git identity
            env.update(GIT_AUTHOR_NAME="imagepipe run-stage", GIT_AUTHOR_EMAIL=f"run-stage@{socket.gethostname()}")
            env.update(GIT_COMMITTER_NAME=env["GIT_AUTHOR_NAME"], GIT_COMMITTER_EMAIL=env["GIT_AUTHOR_EMAIL"])
        git(repo, "read-tree", "HEAD", env=env)
        git(repo, "add", "--force", "dvc.lock", *spec.uncached, *environment_files(stage, stages), env=env)
        tree = git(repo, "write-tree", env=env)
        sha = git(repo, "commit-tree", tree, "-p", "HEAD", "-m", result_message(stage, result), env=env)
    git(repo, "push", "--quiet", "--force", "--", git_remote, f"{sha}:{ref}")
    return sha


@flow(name="run-stage", log_prints=True, validate_parameters=True)
def run_stage_flow(
    stage: str,
    commit: str,
    files: dict[str, str],
    git_remote: str = "origin",
    dvc_remote: str | None = None,
) -> dict[str, Any]:
    """One stage of train-flow on this pool's machine (started by train-flow's placement, not by hand), in
    the checkout the deployment runs in (the worker's own setting, IMAGEPIPE_CHECKOUT): check out `commit`,
    write `files` (dvc.lock, params.yaml), run the environment stage and pull the stage's inputs, run it
    through DVC, push its outputs, and leave its dvc.lock entry and uncached outputs at
    refs/imagepipe/stages/<run id>.

    Every parameter is checked before git or DVC sees it: `git_remote` and `dvc_remote` are names of
    this checkout's configured remotes, `commit` a full 40-hex id on one of the git remote's branches,
    `files` only dvc.lock and params.yaml, `stage` a stage of that commit's dvc.yaml."""
    refuse_overriding_env("run-stage")
    logger = get_run_logger()
    repo = Path.cwd()
    check_files(files)
    check_commit(commit)
    check_git_remote(repo, git_remote)
    check_dvc_remote(repo, dvc_remote)
    _check_out(repo, commit, git_remote)
    check_sent_params(repo, files.get("params.yaml"))
    for name, text in files.items():
        with atomic_file(repo / name) as handle:
            handle.write(text.encode())
    stages = load_stages(repo)
    if stage not in stages or stage == ENVIRONMENT:
        raise PlacementError(f"dvc.yaml of commit {commit[:12]} has no stage {stage!r} to place")
    report = stage_reports(load_params(repo / PARAMS_FILE).paths).get(stage)
    if ENVIRONMENT in stages:  # this machine's own record, which the stage depends on
        run_stage(ENVIRONMENT, str(repo))
    inputs = inputs_to_send(repo, stage, stages)
    if inputs:
        dvc_move(repo, "pull", *inputs, remote=dvc_remote, log=logger.info)
    done = run_stage(stage, str(repo), str(report) if report else None)
    dvc_move(repo, "push", stage, remote=dvc_remote, log=logger.info)
    result = {**done, "host": socket.gethostname(), "commit": commit}
    ref = f"{REFS}/{runtime.flow_run.id}"
    sha = _ship(repo, stage, stages, ref, git_remote, result)
    logger.info("%s: %s; outputs pushed to the DVC remote, dvc.lock entry at %s (%s)", stage, done["outcome"],
                ref, sha[:12])  # fmt: skip
    return result
