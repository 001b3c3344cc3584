"""train-flow: the stages of dvc.yaml as Prefect tasks, each run through `dvc repro --single-item`.

Stages run layer by layer in dvc.yaml's dependency order; the stages of one layer (evaluate and
export) run at the same time. DVC skips what is unchanged and records every run in dvc.lock.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.futures import wait

from flows.dag import layers, load_stages

LOG_TAIL_LINES = 40


class StageFailed(RuntimeError):
    """A dvc stage exited non-zero; the message names it and carries the tail of its log."""


def stage_env() -> dict[str, str]:
    """dvc.yaml's `python -m tasks.<stage>` must find this interpreter's environment first."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


@task(name="dvc-stage", task_run_name="{stage}", cache_policy=None)
def run_stage(stage: str, repo_dir: str) -> str:
    """`dvc repro --single-item <stage>`, its output streamed into the Prefect log as it happens."""
    logger = get_run_logger()
    tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
    command = [sys.executable, "-m", "dvc", "repro", "--single-item", stage]
    with subprocess.Popen(
        command, cwd=repo_dir, env=stage_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, errors="replace",
    ) as proc:  # fmt: skip
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip().rsplit("\r", 1)[-1]
            if line:
                tail.append(line)
                logger.info("%s", line)
    if proc.returncode != 0:
        log_tail = "\n".join(tail)
        raise StageFailed(f"stage {stage!r} failed with exit code {proc.returncode}; last lines:\n{log_tail}")
    return stage


@flow(name="train-flow", log_prints=True)
def train_flow(repo_dir: str = ".", train_retries: int = 1) -> list[str]:
    """Run every stage of dvc.yaml in dependency order; independent stages run concurrently."""
    repo = str(Path(repo_dir).resolve())
    done: list[str] = []
    for layer in layers(load_stages(Path(repo))):
        futures = [
            run_stage.with_options(retries=train_retries if name == "train" else 0).submit(name, repo) for name in layer
        ]
        wait(futures)
        done.extend(future.result() for future in futures)  # raises the first failure
    return done


if __name__ == "__main__":
    train_flow()
