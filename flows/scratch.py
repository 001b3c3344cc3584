"""A scratch checkout that shares this repository's DVC cache, and the command that runs in it.

`make reproduce` (scripts/reproduce.py, a git worktree of REV) and each sweep trial (flows/sweep/trial.py, a
`git clone --shared` of HEAD) work in a checkout of their own under a temporary folder. Both:
- read their data from this workspace's DVC cache (`cache_dir`), with this workspace's untracked DVC settings
  (`copy_local_config`: a remote's URL or credentials kept in .dvc/config.local);
- refuse a `paths.checkpoints` outside the checkout (`checkpoints_outside`): a rerun could take a finished run
  from there instead of training, and parallel trials would share one folder whose pruning deletes another
  trial's running checkpoints;
- run their command (`dvc repro`, `dvc exp run`) as a process group of its own (`ProcessGroup`), stopped as one
  on Ctrl-C, SIGTERM or an error: dvc and every stage it started (train and its workers) end before the
  checkout is removed, instead of writing into a removed folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

DEFAULT_CHECKPOINTS = "runs/checkpoints"


def cache_dir(repo: Path) -> Path:
    """`repo`'s DVC cache folder (`dvc cache dir`: a cache.dir setting, else .dvc/cache)."""
    proc = subprocess.run([sys.executable, "-m", "dvc", "cache", "dir"], cwd=repo, capture_output=True, text=True)
    return Path(proc.stdout.strip()) if proc.returncode == 0 and proc.stdout.strip() else repo / ".dvc" / "cache"


def copy_local_config(repo: Path, tree: Path) -> None:
    """`repo`'s .dvc/config.local (untracked: a remote's URL or credentials) into the checkout `tree`."""
    local = repo / ".dvc" / "config.local"
    if local.is_file():
        shutil.copy2(local, tree / ".dvc" / "config.local")


def checkpoints_outside(params: Mapping[str, Any], tree: Path) -> str | None:
    """`paths.checkpoints` of `params` (params.yaml as read) when it lies outside the checkout `tree`, else None.
    A relative folder is inside unless it climbs out (`..`); an absolute one is outside unless it is under `tree`."""
    folder = str((params.get("paths") or {}).get("checkpoints", DEFAULT_CHECKPOINTS))
    inside = (tree / folder).resolve().is_relative_to(tree.resolve())
    return None if inside else folder


@contextlib.contextmanager
def _shielded() -> Iterator[None]:
    """Ctrl-C and SIGTERM held off while a group is being stopped (the main thread only: signals go there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _members(pgid: int) -> list[psutil.Process]:
    """The live processes of group `pgid` (a zombie no one reaps is not one)."""
    found = []
    for proc in psutil.process_iter(["status"]):
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


class ProcessGroup:
    """`command` as the leader of a process group of its own (`start_new_session`): dvc, the stages it starts and
    their workers are all in it. Used as a context manager, the whole group is stopped when the block is left by
    an exception (KeyboardInterrupt included: the caller turns SIGTERM into one), and the leader is waited for.
    `capture`: stdout and stderr as text lines (`lines()`); else they go where this process's go."""

    def __init__(
        self, command: Sequence[str], *, cwd: Path, env: Mapping[str, str] | None = None, capture: bool = False
    ) -> None:
        pipe = subprocess.PIPE if capture else None
        self.proc = subprocess.Popen(
            list(command), cwd=cwd, env=None if env is None else dict(env), stdout=pipe,
            stderr=subprocess.STDOUT if capture else None, text=True, errors="replace", start_new_session=True,
        )  # fmt: skip
        self.pid = self.proc.pid  # the group's id too

    def lines(self) -> Iterator[str]:
        """Each output line as it comes, without its line end; a progress bar's last redraw only."""
        assert self.proc.stdout is not None, "lines() needs capture=True"
        for raw in self.proc.stdout:
            line = raw.rstrip().rsplit("\r", 1)[-1]
            if line:
                yield line

    def wait(self) -> int:
        return self.proc.wait()

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to every process of the group; SIGKILL to what is left after `grace_s`. Returns when none is
        left (or a few seconds after SIGKILL)."""
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                self.proc.poll()  # the leader, reaped; the others are reparented and reaped by init
                if not _members(self.pid):
                    return
                time.sleep(0.1)

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, trace: TracebackType | None
    ) -> None:
        if kind is not None:
            with _shielded():
                self.stop(grace_s=5.0)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc.wait()
