"""A command (dvc, git) run from a flow: its output streamed line by line into a log as it happens.

Returns the exit code and the last lines, so a failure can be reported with the tail of its log.
"""

from __future__ import annotations

import collections
import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tasks.core.environment import ALLOW_HOOKS_ENV, HOOKS_ENV
from tasks.release.run_record import FLOW_RUN_URL_ENV

LOG_TAIL_LINES = 40


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    tail: str


def flow_run_url(flow_run_id: object) -> str:
    """The flow run's page in the Prefect UI (Prefect's own url_for), or "" when no UI URL is known."""
    from prefect.utilities.urls import url_for

    return url_for("flow-run", obj_id=str(flow_run_id)) or ""


def stage_env(drop: Iterable[str] = ()) -> dict[str, str]:
    """This process's environment for dvc and its stages: dvc.yaml's `python -m tasks.<stage>` finds this
    interpreter's environment first; `drop`: variables the caller's run must not inherit (OVERRIDING_ENV's)."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("DVC_NO_ANALYTICS", "1")
    for name in drop:
        env.pop(name, None)
    # The flow run a stage belongs to, for the MLflow run its gate logs (tasks/release/tracking.py): a worker's flow
    # process has PREFECT__FLOW_RUN_ID already; a flow run started in this process does not. A process that never
    # imported Prefect (make reproduce) runs no flow: it does not pay Prefect's import to find that out.
    if "prefect" in sys.modules:
        with contextlib.suppress(Exception):
            from prefect import runtime

            if runtime.flow_run.id:
                env.setdefault("PREFECT__FLOW_RUN_ID", str(runtime.flow_run.id))
                env.setdefault(FLOW_RUN_URL_ENV, flow_run_url(runtime.flow_run.id))
    return env


def stream(command: Sequence[str], *, cwd: Path, log: Callable[[str], None]) -> CommandResult:
    """Run `command`, handing each output line to `log` as it arrives (progress bars: last redraw only)."""
    tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
    with subprocess.Popen(
        list(command), cwd=cwd, env=stage_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, errors="replace",
    ) as proc:  # fmt: skip
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip().rsplit("\r", 1)[-1]
            if line:
                tail.append(line)
                log(line)
    return CommandResult(proc.returncode, "\n".join(tail))


# Environment variables that change what a production run records or runs: the gate (`dvc exp run`'s
# DVC_EXP_NAME makes check_regression record a verdict without enforcing it),
# the training hooks (test code loaded into the train stage, and the faults they plant), and the checkout
# a placed stage runs in. A flow run's job variables could set them on a worker; the work pools' base job
# template (flows/process_pool_template.json) no longer lets a flow run set any `env`, and the flows refuse
# to start when one is there all the same (a worker started with it, an older pool).
GATE_ENV = {
    "DVC_EXP_NAME": "the regression gate (set by `dvc exp run`: the verdict would be recorded, not enforced)",
}
HOOK_ENV = {
    HOOKS_ENV: "the training hooks (test code loaded into the train stage)",
    ALLOW_HOOKS_ENV: "the training hooks",
    "IMAGEPIPE_FAULT": "the training hooks (planted faults: tests/helpers/faults.py)",
}
CHECKOUT_ENV = "IMAGEPIPE_CHECKOUT"  # a worker's own checkout (scripts/prefect.sh worker): run-stage's pull step
OVERRIDING_ENV = {**GATE_ENV, **HOOK_ENV, CHECKOUT_ENV: "the checkout a stage runs in"}
# What a run of committed code drops from the environment it was started in (make reproduce, a sweep's trials):
# the gate's switches and a test's training hooks
NOT_INHERITED = (*GATE_ENV, *HOOK_ENV)


class OverriddenEnvironment(RuntimeError):
    """A flow's environment carries a variable that changes the gate, the hooks or the checkout."""


def refuse_overriding_env(flow: str) -> None:
    """Raise, in one line naming each variable and what it changes, when this process's environment holds a
    variable of OVERRIDING_ENV. IMAGEPIPE_CHECKOUT is the worker's own setting (run-stage's pull step moves into
    it), so it passes when it names the directory the flow runs in, and only then."""
    found = [name for name in OVERRIDING_ENV if os.environ.get(name) is not None]
    checkout = os.environ.get(CHECKOUT_ENV)
    if checkout is not None and Path(checkout).resolve() == Path.cwd().resolve():
        found.remove(CHECKOUT_ENV)
    if found:
        named = "; ".join(f"{name} (changes {OVERRIDING_ENV[name]})" for name in found)
        raise OverriddenEnvironment(
            f"{flow} refuses to run with {named} in its environment: a production run neither sets nor inherits "
            "it. Unset it where the worker was started, and check the work pool's job variables "
            "(`prefect work-pool inspect`)"
        )
