"""One stage of dvc.yaml as a Prefect task: `dvc repro --single-item <stage>`, streamed into the log.

train-flow submits one per stage; the run-stage flow (flows/placement/receive.py) runs the same task on the
machine a stage is placed on. DVC decides whether the stage runs and records it in dvc.lock.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from flows.artifacts import publish_report
from flows.explain import why_stage_runs
from flows.shell import stream

__all__ = ["OUTCOMES", "StageFailed", "dvc_command", "run_stage"]

# DVC's own words for a stage it did not run (dvc/stage/__init__.py, dvc/stage/cache.py).
OUTCOMES = {"didn't change, skipping": "unchanged", "is cached - skipping run": "restored from run cache"}


class StageFailed(RuntimeError):
    """A dvc command exited non-zero; the message names the stage and carries the tail of its log."""


def dvc_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "dvc", *args]


@task(name="dvc-stage", task_run_name="{stage}", cache_policy=None)
def run_stage(stage: str, repo_dir: str, report: str | None = None) -> dict[str, Any]:
    """`dvc repro --single-item <stage>`, its output streamed into the Prefect log as it happens.

    Returns {"outcome": what DVC did ("ran", "unchanged" or "restored from run cache"), "why": the reasons
    DVC's status gave just before (flows/explain.py), [] when nothing had changed}. The stage's JSON report
    (`report`, relative to the repo) becomes an artifact, also when the stage failed after writing it
    (check_regression writes its verdict, then exits 1).
    """
    logger = get_run_logger()
    repo = Path(repo_dir)
    outcome = "ran"
    try:
        why = why_stage_runs(repo, stage)
    except (RuntimeError, OSError, ValueError) as exc:  # the explanation is not worth failing the stage for
        why = [f"(DVC status unavailable: {exc})"]
    logger.info("why %s: %s", stage, "; ".join(why) or "nothing changed, DVC will skip it")

    def log(line: str) -> None:
        nonlocal outcome
        outcome = next((name for words, name in OUTCOMES.items() if words in line), outcome)
        logger.info("%s", line)

    started = time.time()
    result = stream(dvc_command("repro", "--single-item", "--", stage), cwd=repo, log=log)
    report_path = repo / report if report else None
    if report_path and report_path.is_file() and (result.returncode == 0 or report_path.stat().st_mtime >= started):
        publish_report(stage, report_path)
    if result.returncode != 0:
        raise StageFailed(f"stage {stage!r} failed with exit code {result.returncode}; last lines:\n{result.tail}")
    return {"outcome": outcome, "why": why}
