"""train-flow: the stages of dvc.yaml as Prefect tasks, each run through `dvc repro --single-item`.

Each stage's task is submitted with `wait_for` the stages it depends on (the graph DVC builds from
dvc.yaml), so it starts as soon as its own inputs are ready, independent stages (evaluate and export)
run at the same time, and the Prefect UI draws the DAG's edges. DVC skips what is unchanged and
records every run in dvc.lock.
Per run: artifacts (metrics, export parity, regression verdict, run manifest), reports/run_manifest.json,
and `dvc push` when a DVC remote is configured.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from prefect import flow, get_run_logger, runtime, task
from prefect.futures import PrefectFuture, wait
from prefect.states import Crashed, State
from pydantic import Field

from flows.artifacts import (
    KEYS,
    picture_paths,
    publish_comparison,
    publish_manifest,
    publish_why,
    stage_reports,
)
from flows.explain import comparison_markdown, previous_completed_run, why_markdown
from flows.manifest import build_manifest
from flows.placement import StageCrashed, check_dvc_remote, check_git_remote, check_placement, placed_stage
from flows.shell import refuse_overriding_env, stage_env, stream
from flows.stage import StageFailed, dvc_command, run_stage
from tasks.core.dag import Stage, load_stages
from tasks.core.io import read_json, write_json
from tasks.core.params import PARAMS_FILE, Params, load_params
from tasks.core.private_api import dvc_remotes

__all__ = ["StageFailed", "run_stage", "stage_env", "train_flow"]


@task(name="dvc-push", cache_policy=None)
def push_outputs(repo_dir: str, remote: str | None = None) -> str:
    """`dvc push` to the named or default remote; with no remote configured, say so and push nothing."""
    logger = get_run_logger()
    repo = Path(repo_dir)
    if not dvc_remotes(repo)[0]:
        logger.warning(
            "no DVC remote configured: this run's outputs stay only in %s/.dvc/cache "
            "(add one with `dvc remote add -d storage s3://bucket/path` or an ssh:// URL to keep them)",
            repo,
        )
        return "no remote"
    result = stream(dvc_command("push", *(["--remote", remote] if remote else [])), cwd=repo, log=logger.info)
    if result.returncode != 0:
        raise StageFailed(f"dvc push failed with exit code {result.returncode}; last lines:\n{result.tail}")
    return f"pushed to {remote or 'the default remote'}"


def record_run(repo: Path, params: Params, stages: dict[str, str], why: dict[str, list[str]], status: str) -> Path:
    """reports/run_manifest.json + its artifact, and the why and comparison artifacts. Not a DVC output,
    so `dvc status` stays clean."""
    logger = get_run_logger()
    flow_run = {
        "flow_run_id": runtime.flow_run.id,
        "flow_run_name": runtime.flow_run.name,
        "deployment": runtime.deployment.name,
    }
    # Read before this run's manifest exists as an artifact: the previous one is another run's.
    try:
        previous, previous_name = previous_completed_run(runtime.flow_run.id, runtime.deployment.id, KEYS["manifest"])
    except Exception as exc:  # an API hiccup must not fail a finished run
        logger.warning("could not read the previous run to compare with: %s", exc)
        previous, previous_name = None, None
    manifest = build_manifest(repo, params, flow_run=flow_run, stages=stages, status=status, why=why)
    path = repo / params.paths.run_manifest
    write_json(path, manifest)
    publish_manifest(manifest, path.relative_to(repo))
    publish_why(why_markdown(stages, why))
    baseline = repo / params.paths.baseline_metrics
    pictures = {p.name: repo / p for p in picture_paths(params.paths)}
    publish_comparison(comparison_markdown(manifest, previous, previous_name,
                                           read_json(baseline) if baseline.is_file() else None, pictures))  # fmt: skip
    return path


def _outcome(future: PrefectFuture[dict[str, Any]]) -> str:
    state = future.state
    if state.is_completed():
        return future.result()["outcome"]
    return state.name.lower() if state.is_final() else "not run"  # NotReady: an upstream stage failed


def _why(future: PrefectFuture[dict[str, Any]]) -> list[str] | None:
    return future.result()["why"] if future.state.is_completed() else None


@flow(name="train-flow", log_prints=True)
def train_flow(
    train_retries: Annotated[int, Field(ge=0, le=10)] = 1,
    retry_delay_seconds: Annotated[float, Field(ge=0)] = 10.0,
    push: bool = True,
    remote: str | None = None,
    placement: dict[str, str] | None = None,
    git_remote: str = "origin",
) -> dict[str, str] | State:
    """Run every stage of dvc.yaml, each as soon as its upstream stages are done; independent ones concurrently.

    Operational knobs only (hyperparameters live in params.yaml): `train_retries` reruns a failed
    train stage, which resumes from its checkpoint; `push`/`remote` choose where `dvc push` sends
    the outputs at the end (and where a placed stage's inputs and outputs travel); `placement` maps a
    stage to the work pool that runs it (flows/placement/), through `git_remote`. Returns each
    stage's outcome; Crashed when a placed stage's machine died.

    It runs in the checkout its deployment names (the working directory): no parameter points it at
    another repository. `remote` and `git_remote` are names of this checkout's configured remotes.
    """
    refuse_overriding_env("train-flow")
    logger = get_run_logger()
    repo = Path.cwd()
    params = load_params(repo / PARAMS_FILE)
    stages = load_stages(repo)
    placement = placement or {}
    check_placement(placement, stages)
    check_dvc_remote(repo, remote)
    if placement:
        check_git_remote(repo, git_remote)
    outcomes = {name: "not run" for name in stages}
    why: dict[str, list[str]] = {}
    reports = {name: str(path) for name, path in stage_reports(params.paths).items()}
    try:
        futures = _submit(stages, repo, reports, placement, git_remote, remote, train_retries, retry_delay_seconds)
        wait(list(futures.values()))
        outcomes.update({name: _outcome(future) for name, future in futures.items()})
        why.update({name: reasons for name, future in futures.items() if (reasons := _why(future)) is not None})
        for future in futures.values():
            if future.state.is_final():
                future.result()  # raises the first failure in DAG order, naming its stage
        if push:
            # after every stage, drawn so in the UI
            outcomes["dvc push"] = push_outputs.submit(str(repo), remote, wait_for=list(futures.values())).result()
    except StageCrashed as exc:  # the placed stage's machine died: say Crashed, as its own run does
        try:
            record_run(repo, params, outcomes, why, "crashed")
        except Exception:
            logger.exception("could not write the run manifest")
        logger.error("%s", exc)
        return Crashed(message=str(exc))
    except BaseException:
        try:
            record_run(repo, params, outcomes, why, "failed")
        except Exception:  # the stage failure is the error to report, not a manifest problem
            logger.exception("could not write the run manifest")
        raise
    path = record_run(repo, params, outcomes, why, "completed")
    logger.info("stages: %s; run manifest -> %s", outcomes, path)
    return outcomes


def _submit(
    stages: dict[str, Stage], repo: Path, reports: dict[str, str], placement: dict[str, str], git_remote: str,
    remote: str | None, train_retries: int, retry_delay_seconds: float,
) -> dict[str, PrefectFuture[dict[str, Any]]]:  # fmt: skip
    """One task per stage, each waiting for its upstream stages; a placed stage as a run of run-stage/<pool>."""
    futures: dict[str, PrefectFuture[dict[str, Any]]] = {}
    for name, stage in stages.items():  # upstream stages come first
        options = {"retries": train_retries if name == "train" else 0, "retry_delay_seconds": retry_delay_seconds}
        after = [futures[up] for up in sorted(stage.upstream)]
        if name in placement:  # on another machine: a subflow of this run
            futures[name] = placed_stage.with_options(**options).submit(
                name, placement[name], str(repo), git_remote, remote, wait_for=after
            )
        else:
            futures[name] = run_stage.with_options(**options).submit(name, str(repo), reports.get(name),
                                                                     wait_for=after)  # fmt: skip
    return futures


if __name__ == "__main__":
    train_flow()
