"""Placement: one stage of dvc.yaml on another machine, through a Prefect work pool of its own.

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
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from dvc.repo import Repo
from dvc.utils.serialize import modify_yaml
from prefect import flow, get_run_logger, runtime, task
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound

from flows.artifacts import stage_reports
from flows.dag import Stage, load_stages
from flows.explain import why_stage_runs
from flows.shell import output, stream
from flows.stage import StageFailed, dvc_command, run_stage
from tasks.core.io import atomic_file
from tasks.core.params import PARAMS_FILE, Params, load_params

__all__ = ["DEPLOYMENT", "StageCrashed", "check_placement", "placed_stage", "run_stage_flow"]

DEPLOYMENT = "run-stage/{pool}"  # the deployment that runs a placed stage on `pool` (prefect.yaml)
REFS = "refs/imagepipe/stages"  # where a placed run leaves its dvc.lock and uncached outputs in git
SENT = ("dvc.lock", "params.yaml")  # what train-flow sends along with the commit
COMMIT = re.compile(r"[0-9a-f]{40}")
ENVIRONMENT = "environment"  # the stage that describes a machine: each machine runs it for itself
# train params a sent params.yaml may not change: what the stage reads, and whom it connects to
PINNED_TRAIN = ("init_from", "nnodes", "rdzv_endpoint", "rdzv_timeout_s", "nproc_per_node")


class PlacementError(StageFailed):
    """A placed stage cannot be sent or taken back; the message says what to do."""


class StageCrashed(StageFailed):
    """The run-stage flow run of a placed stage ended Crashed: its machine, worker or flow process died."""


class StageCancelled(StageFailed):
    """Someone cancelled the run-stage flow run of a placed stage: not retried."""


def check_placement(placement: dict[str, str], stages: dict[str, Stage]) -> None:
    for stage, pool in placement.items():
        if stage not in stages:
            raise ValueError(f"placement names stage {stage!r}, which dvc.yaml does not have ({', '.join(stages)})")
        if stage == ENVIRONMENT:
            raise ValueError(f"placement names stage {stage!r}: it describes the machine it runs on, so every "
                             "machine runs it for itself; it cannot be placed")  # fmt: skip
        if not pool or not isinstance(pool, str):
            raise ValueError(f"placement of stage {stage!r}: {pool!r} is not a work pool name")


# -- git ----------------------------------------------------------------------------------------


def git(repo: Path, *args: str, env: dict[str, str] | None = None) -> str:
    return git_bytes(repo, *args, env=env).decode().strip()


def git_bytes(repo: Path, *args: str, env: dict[str, str] | None = None) -> bytes:
    proc = subprocess.run(["git", *args], cwd=repo, capture_output=True, env=env)
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).decode(errors="replace").strip()[-500:]
        raise PlacementError(f"`git {' '.join(args)}` in {repo} failed: {said}")
    return proc.stdout


def check_git_remote(repo: Path, name: str) -> str:
    """`name` when it is one of the checkout's configured git remotes; anything else (a URL, an option,
    a path) is refused, so a flow parameter never reaches git as anything but a remote's name."""
    remotes = git(repo, "remote").split()
    if not isinstance(name, str) or name not in remotes:
        raise PlacementError(
            f"git_remote {name!r} is not a git remote of {repo} (configured: {', '.join(remotes) or 'none'}): the "
            "flow takes a configured remote's name, never a URL, a path or an option"
        )
    return name


def check_dvc_remote(repo: Path, name: str | None) -> str | None:
    """`name` when it is one of the checkout's configured DVC remotes (None: the default one)."""
    if name is None:
        return None
    with Repo(str(repo)) as dvc_repo:
        remotes = sorted(dvc_repo.config.get("remote", {}))
    if not isinstance(name, str) or name not in remotes:
        raise PlacementError(
            f"DVC remote {name!r} is not configured in {repo} (configured: {', '.join(remotes) or 'none'}): the "
            "flow takes a configured DVC remote's name, never a URL, a path or an option"
        )
    return name


def check_commit(commit: str) -> str:
    if not isinstance(commit, str) or not COMMIT.fullmatch(commit):
        raise PlacementError(f"commit {commit!r} is not a full 40-hex commit id")
    return commit


def on_remote_branch(repo: Path, commit: str, git_remote: str) -> bool:
    """After a fetch from `git_remote`: is `commit` on one of its branches (not only somewhere in this clone)?"""
    check_commit(commit)  # hex only, before git sees it
    git(repo, "fetch", "--quiet", "--prune", "--", git_remote)  # a branch deleted there is gone here too
    if subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=repo).returncode != 0:
        return False
    return bool(git(repo, "branch", "--remotes", "--contains", commit, "--list", f"{git_remote}/*"))


def changed_files(repo: Path) -> list[str]:
    """Tracked files that differ from HEAD (staged or not)."""
    out = git_bytes(repo, "status", "--porcelain=v1", "--untracked-files=no", "-z").decode()
    return [entry[3:] for entry in out.split("\0") if entry]  # "XY path"


def written_by_runs(repo: Path, stages: dict[str, Stage]) -> set[str]:
    """What a pipeline run itself changes in a checkout: dvc.lock, the uncached outputs, params.yaml
    (`dvc exp run -S`), the .gitignore files DVC keeps for the cached ones, and train-flow's manifest."""
    outs = {path for stage in stages.values() for path in stage.uncached}
    ignores = {str(Path(path).parent / ".gitignore") for stage in stages.values() for path in stage.outs}
    manifest = str(load_params(repo / PARAMS_FILE).paths.run_manifest)
    return {*SENT, *outs, *ignores, ".gitignore", manifest}


def changed_by_hand(repo: Path, stages: dict[str, Stage]) -> list[str]:
    """Tracked files that differ from HEAD for another reason than a run writing them."""
    return sorted(set(changed_files(repo)) - written_by_runs(repo, stages))


# -- this machine: send the stage, take it back --------------------------------------------------


def environment_files(stage: str, stages: dict[str, Stage]) -> list[str]:
    """The stage's record of its machine (reports/environment/<stage>.json): each machine writes its own, by
    running the environment stage itself; the placed stage's comes back with its dvc.lock entry."""
    made_here = set(stages[ENVIRONMENT].outs) if ENVIRONMENT in stages else set()
    return [dep for dep in stages[stage].deps if dep in made_here]


def inputs_to_send(repo: Path, stage: str, stages: dict[str, Stage]) -> list[str]:
    """What `dvc push` here and `dvc pull` there move: the upstream stages' cached outputs, and the files that
    .dvc files in the stage's dependency folders track. The environment stage is run on each machine instead."""
    return [*sorted(stages[stage].upstream - {ENVIRONMENT}), *dvc_files_in_deps(repo, stage, stages)]


def _tracked(repo: Path, stages: dict[str, Stage]) -> set[str]:
    return set(git(repo, "ls-files", "-z").split("\0")) - (written_by_runs(repo, stages) - {"params.yaml"})


def dvc_files_in_deps(repo: Path, stage: str, stages: dict[str, Stage]) -> list[str]:
    """The commit's .dvc files inside the stage's dependency folders (train's models/pretrained): the files
    they track reach the other machine through the DVC remote, `dvc push` here and `dvc pull` there."""
    folders = [dep.rstrip("/") + "/" for dep in stages[stage].deps if (repo / dep).is_dir()]
    return sorted(path for path in _tracked(repo, stages) if path.endswith(".dvc") and path.startswith(tuple(folders)))


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
    tracked = _tracked(repo, stages)
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


def _dvc(repo: Path, *args: str, remote: str | None, log: Any) -> None:
    command = dvc_command(*args[:1], *(["--remote", remote] if remote else []), "--", *args[1:])
    result = stream(command, cwd=repo, log=log)
    if result.returncode != 0:
        raise StageFailed(f"`dvc {' '.join(args)}` failed with exit code {result.returncode}:\n{result.tail}")


def _warn_if_nobody_serves(pool: str) -> None:
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
    check_git_remote(repo, git_remote)
    check_dvc_remote(repo, dvc_remote)
    if not output(dvc_command("remote", "list"), cwd=repo):
        raise PlacementError(
            f"placing {stage} on pool {pool} needs a DVC remote that both machines reach: "
            "`dvc remote add -d storage <url>`, committed in .dvc/config"
        )
    _check_inputs(repo, stage, stages)
    commit = _commit_on_remote(repo, git_remote, pool)
    inputs = inputs_to_send(repo, stage, stages)
    if inputs:  # for the other machine's `dvc pull`
        _dvc(repo, "push", *inputs, remote=dvc_remote, log=logger.info)
    with dvc_lock(repo):  # a stage running here may be writing dvc.lock right now
        files = {name: (repo / name).read_text() for name in SENT if (repo / name).is_file()}
    deployment = DEPLOYMENT.format(pool=pool)
    _warn_if_nobody_serves(pool)
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
    result = json.loads(message.split("\n\n", 1)[1])
    entry = yaml.safe_load(git_bytes(repo, "show", f"{sha}:dvc.lock"))["stages"][stage]
    for path in [*spec.uncached, *environment_files(stage, stages)]:
        with atomic_file(repo / path) as handle:
            handle.write(git_bytes(repo, "show", f"{sha}:{path}"))
    with dvc_lock(repo), modify_yaml(str(repo / "dvc.lock")) as lock:  # DVC's round trip, as Lockfile.dump
        lock.setdefault("schema", "2.0")
        lock.setdefault("stages", {})[stage] = entry
    _dvc(repo, "pull", stage, remote=dvc_remote, log=logger.info)
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


@contextlib.contextmanager
def dvc_lock(repo: Path) -> Iterator[None]:
    """DVC's repository lock, which `dvc repro` holds while it writes dvc.lock (not while a stage runs)."""
    with Repo(str(repo), _wait_for_lock=True) as dvc_repo, dvc_repo.lock:  # = dvc --wait-for-lock
        yield


def _ignore(repo: Path, path: str) -> None:
    """The line DVC's own run would have added to the .gitignore beside a cached output (`dvc pull`
    does not), so git never sees models/model.pt as a file to add."""
    gitignore = repo / Path(path).parent / ".gitignore"
    entry = f"/{Path(path).name}"
    lines = gitignore.read_text().splitlines() if gitignore.is_file() else []
    if entry not in lines:
        gitignore.write_text("".join(f"{line}\n" for line in [*lines, entry]))


# -- the pool's machine: the run-stage flow --------------------------------------------------------


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
        if not _has_config(repo, "user.email"):  # a worker's clone may have no git identity
            env.update(GIT_AUTHOR_NAME="imagepipe run-stage", GIT_AUTHOR_EMAIL=f"run-stage@{socket.gethostname()}")
            env.update(GIT_COMMITTER_NAME=env["GIT_AUTHOR_NAME"], GIT_COMMITTER_EMAIL=env["GIT_AUTHOR_EMAIL"])
        git(repo, "read-tree", "HEAD", env=env)
        git(repo, "add", "--force", "dvc.lock", *spec.uncached, *environment_files(stage, stages), env=env)
        tree = git(repo, "write-tree", env=env)
        message = f"{stage} ran on {result['host']}: {result['outcome']}\n\n{json.dumps(result, sort_keys=True)}"
        sha = git(repo, "commit-tree", tree, "-p", "HEAD", "-m", message, env=env)
    git(repo, "push", "--quiet", "--force", "--", git_remote, f"{sha}:{ref}")
    return sha


def _has_config(repo: Path, key: str) -> bool:
    return subprocess.run(["git", "config", key], cwd=repo, capture_output=True).returncode == 0


def _check_sent_params(repo: Path, text: str | None) -> None:
    """The params.yaml train-flow sends may carry other hyperparameters than the commit's (`dvc exp run -S`),
    but it must validate, and what says where a stage reads, writes or connects must be the commit's: `paths`,
    `data.source`, `data.test_source`, and train's init_from and multi-node rendezvous (a rank unpickles what
    its peers send). That is the commit's setting, not something a flow run chooses."""
    if text is None:
        return
    try:
        sent = Params.model_validate(yaml.safe_load(text))
    except (yaml.YAMLError, ValueError) as exc:
        raise PlacementError(f"the params.yaml sent with this run does not validate: {str(exc)[:500]}") from None
    committed = load_params(repo / PARAMS_FILE)
    places = {f"paths.{name}": (getattr(sent.paths, name), getattr(committed.paths, name))
              for name in type(committed.paths).model_fields}  # fmt: skip
    places |= {f"data.{name}": (getattr(sent.data, name), getattr(committed.data, name))
               for name in ("source", "test_source")}  # fmt: skip
    places |= {f"train.{name}": (getattr(sent.train, name), getattr(committed.train, name)) for name in PINNED_TRAIN}
    changed = [key for key, (theirs, ours) in places.items() if theirs != ours]
    if changed:
        raise PlacementError(
            f"the params.yaml sent with this run changes {', '.join(changed)}: a placed stage reads and writes "
            "where the commit's params.yaml says"
        )


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
    logger = get_run_logger()
    repo = Path.cwd()
    unknown = sorted(set(files) - set(SENT))
    if unknown or not all(isinstance(text, str) for text in files.values()):
        raise PlacementError(f"run-stage takes only {', '.join(SENT)} as text in `files`, not {', '.join(unknown)}")
    check_commit(commit)
    check_git_remote(repo, git_remote)
    check_dvc_remote(repo, dvc_remote)
    _check_out(repo, commit, git_remote)
    _check_sent_params(repo, files.get("params.yaml"))
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
        _dvc(repo, "pull", *inputs, remote=dvc_remote, log=logger.info)
    done = run_stage(stage, str(repo), str(report) if report else None)
    _dvc(repo, "push", stage, remote=dvc_remote, log=logger.info)
    result = {**done, "host": socket.gethostname(), "commit": commit}
    ref = f"{REFS}/{runtime.flow_run.id}"
    sha = _ship(repo, stage, stages, ref, git_remote, result)
    logger.info("%s: %s; outputs pushed to the DVC remote, dvc.lock entry at %s (%s)", stage, done["outcome"],
                ref, sha[:12])  # fmt: skip
    return result
