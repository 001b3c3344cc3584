"""Git queries every part of the project asks the same way: a command's output (or None where git fails or
there is no repository), and the tracked files that differ from HEAD."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def git_output(repo: Path, *args: str, timeout_s: float = 30, strip: bool = True) -> str | None:
    """stdout of `git <args>` in `repo` (stripped unless `strip` is False: porcelain's status columns start with a
    space); None when git is missing, fails or takes over `timeout_s`."""
    try:
        proc = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    return proc.stdout.strip() if strip else proc.stdout


def head_commit(repo: Path) -> str | None:
    """HEAD's full sha, or None (no repository, no commit yet)."""
    return git_output(repo, "rev-parse", "HEAD") or None


def changed_files(repo: Path, *paths: str) -> list[str]:
    """Tracked files that differ from HEAD, staged or not (limited to `paths` when given)."""
    out = git_output(repo, "status", "--porcelain=v1", "--untracked-files=no", "-z", *(["--", *paths] if paths else []),
                     strip=False)  # fmt: skip
    return [entry[3:] for entry in (out or "").split("\0") if entry]  # "XY path"


def author(repo: Path = Path()) -> str:
    """Who acts here, for a recorded decision: `git config user.name`, else the login name, else "unknown"
    or the uid (a container's may have no passwd entry)."""
    import getpass

    try:
        login = getpass.getuser()
    except (KeyError, OSError):
        login = f"uid {os.getuid()}"
    return git_output(repo, "config", "user.name") or login
