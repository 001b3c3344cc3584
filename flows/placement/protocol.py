"""The placement protocol: what the sending checkout and the receiving worker both know.

The deployment a pool's stage runs as, what is sent with the commit (dvc.lock and params.yaml, and
which params a sent params.yaml may not move), the git ref where the placed run leaves its result and
that result's commit message, the environment stage that each machine runs for itself, and the errors.
Imported by flows/placement/send.py and flows/placement/receive.py; imports neither.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from flows.shell import stream
from flows.stage import StageFailed, dvc_command
from tasks.core.dag import Stage
from tasks.core.params import PARAMS_FILE, Params, load_params
from tasks.core.private_api import dvc_remotes

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


def check_commit(commit: str) -> str:
    if not isinstance(commit, str) or not COMMIT.fullmatch(commit):
        raise PlacementError(f"commit {commit!r} is not a full 40-hex commit id")
    return commit


def check_dvc_remote(repo: Path, name: str | None) -> str | None:
    """`name` when it is one of the checkout's configured DVC remotes (None: the default one)."""
    if name is None:
        return None
    remotes = sorted(dvc_remotes(repo)[0])
    if not isinstance(name, str) or name not in remotes:
        raise PlacementError(
            f"DVC remote {name!r} is not configured in {repo} (configured: {', '.join(remotes) or 'none'}): the "
            "flow takes a configured DVC remote's name, never a URL, a path or an option"
        )
    return name


def check_files(files: dict[str, Any]) -> None:
    """What run-stage takes in `files`: only the SENT names, as text."""
    unknown = sorted(set(files) - set(SENT))
    if unknown or not all(isinstance(text, str) for text in files.values()):
        raise PlacementError(f"run-stage takes only {', '.join(SENT)} as text in `files`, not {', '.join(unknown)}")


def check_sent_params(repo: Path, text: str | None) -> None:
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


def environment_files(stage: str, stages: dict[str, Stage]) -> list[str]:
    """The stage's record of its machine (reports/environment/<stage>.json): each machine writes its own, by
    running the environment stage itself; the placed stage's comes back with its dvc.lock entry."""
    made_here = set(stages[ENVIRONMENT].outs) if ENVIRONMENT in stages else set()
    return [dep for dep in stages[stage].deps if dep in made_here]


def result_message(stage: str, result: dict[str, Any]) -> str:
    """The commit message of a placed run's result: a line for people, then the result as JSON."""
    return f"{stage} ran on {result['host']}: {result['outcome']}\n\n{json.dumps(result, sort_keys=True)}"


def read_result(message: str) -> dict[str, Any]:
    return json.loads(message.split("\n\n", 1)[1])


def dvc_move(repo: Path, *args: str, remote: str | None, log: Any) -> None:
    """`dvc push|pull` of `args[1:]` (stage names and files, after `--`) to or from `remote`."""
    command = dvc_command(*args[:1], *(["--remote", remote] if remote else []), "--", *args[1:])
    result = stream(command, cwd=repo, log=log)
    if result.returncode != 0:
        raise StageFailed(f"`dvc {' '.join(args)}` failed with exit code {result.returncode}:\n{result.tail}")
