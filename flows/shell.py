"""A command (dvc, git) run from a flow: its output streamed line by line into a log as it happens.

Returns the exit code and the last lines, so a failure can be reported with the tail of its log.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

LOG_TAIL_LINES = 40


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    tail: str


def stage_env() -> dict[str, str]:
    """dvc.yaml's `python -m tasks.<stage>` must find this interpreter's environment first."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("DVC_NO_ANALYTICS", "1")
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


def output(command: Sequence[str], *, cwd: Path) -> str | None:
    """stdout of a short query command, or None when it fails (no git repository, no commit yet)."""
    proc = subprocess.run(list(command), cwd=cwd, env=stage_env(), capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None
