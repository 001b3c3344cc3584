"""Is DVC's repository lock (.dvc/tmp/lock) held, e.g. by `make run`'s `dvc repro`? Asked as DVC asks it: its
own lock class (dvc/lock.py make_lock, zc.lockfile or, with core.hardlink_lock, flufl), taken and released.

A take-in, a fix-in-place or an accept refuses in one line while it is held, before anything moves: their
`dvc status` / `dvc add` would wait on it or fail half-way through.
"""

from __future__ import annotations

from pathlib import Path

import psutil

from tasks.tools.review.refusals import Refusal


def _holder(lockfile: Path) -> str:
    """`pid N: <its command>` from the pid zc.lockfile writes into the file, or '' when it cannot be told."""
    try:
        pid = int(lockfile.read_text().split()[0])
        command = " ".join(psutil.Process(pid).cmdline()[:4])
    except (OSError, ValueError, IndexError, psutil.Error):
        return ""
    return f" by pid {pid} ({command})" if command else f" by pid {pid}"


def check_unlocked(root: Path, action: str) -> None:
    """Refusal naming the lock and its holder while another DVC process holds it; returns when it is free."""
    dvc_dir = root / ".dvc"
    if not dvc_dir.is_dir():
        return
    from dvc.config import Config
    from dvc.lock import LockError, make_lock

    tmp_dir = dvc_dir / "tmp"
    tmp_dir.mkdir(exist_ok=True)
    hardlink = bool(Config(dvc_dir=str(dvc_dir))["core"].get("hardlink_lock", False))
    lock = make_lock(str(tmp_dir / "lock"), tmp_dir=str(tmp_dir), hardlink_lock=hardlink)
    try:
        lock.lock()  # DVC's own retries: about 3 s, so a short `dvc status` of someone else's passes
    except LockError:
        raise Refusal(f"{action}: DVC's lock .dvc/tmp/lock is held{_holder(tmp_dir / 'lock')}; try again when DVC is "
                      "done") from None  # fmt: skip
    lock.unlock()
