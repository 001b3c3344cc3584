"""The one place that touches DVC's and torch's private APIs: each has a named wrapper here, and
tests/core/test_private_api.py fails when a pinned version (constraints.txt) changes its behaviour.

- `dvc_repo(path)`: DVC's Repo with `_wait_for_lock=True` (what `dvc --wait-for-lock` does), so a
  read of the status or a write of dvc.lock waits for a running `dvc repro` instead of failing;
- `dvc_busy(root)`: DVC's repository lock and its rwlock file, asked as DVC asks them: is `dvc repro` at work?
- `edit_yaml(path)`: `dvc.utils.serialize.modify_yaml`, DVC's round-trip YAML editor (comments and
  key order kept), as its Lockfile.dump writes dvc.lock;
- `set_params(file, overrides)`: `dvc.utils.hydra.apply_overrides`, the writer behind `dvc exp run -S`;
- `cpu_native_bf16()`: `torch.cpu._is_avx512_bf16_supported` / `_is_amx_tile_supported`, the only
  way torch tells whether this CPU has bf16 arithmetic.

The imports are inside the functions: a module that needs one wrapper loads neither torch nor DVC
for the others (tasks/core imports nothing heavy at import time).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dvc.repo import Repo


@contextlib.contextmanager
def dvc_repo(path: Path) -> Iterator[Repo]:
    """DVC's Repo for `path`, whose locked operations (status, writing dvc.lock) wait for the lock."""
    from dvc.repo import Repo

    with Repo(str(path), _wait_for_lock=True) as repo:
        yield repo


@contextlib.contextmanager
def dvc_locked(path: Path) -> Iterator[None]:
    """Hold DVC's repository lock, which `dvc repro` holds while it writes dvc.lock (not while a stage runs)."""
    with dvc_repo(path) as repo, repo.lock:
        yield


def dvc_busy(root: Path) -> str | None:
    """Which DVC command is at work in the repository at `root` (`dvc repro` of make run, `dvc add`, ...), as
    `pid N (its command)`, or None. DVC's repository lock (.dvc/tmp/lock, taken with DVC's own lock class and
    released) is held only while DVC reads or writes its state; while a stage's command runs, DVC holds that
    stage's deps and outs in its rwlock file instead (.dvc/tmp/rwlock, entries of live pids): both are asked."""
    import json

    import psutil
    from dvc.config import Config
    from dvc.lock import LockError, make_lock

    tmp_dir = root / ".dvc" / "tmp"
    if not tmp_dir.parent.is_dir():
        return None
    tmp_dir.mkdir(exist_ok=True)

    def holder(pid: int) -> str | None:
        try:
            return f"pid {pid} ({' '.join(psutil.Process(pid).cmdline()[:5])})"
        except psutil.Error:
            return None  # gone: a stale entry

    try:
        rwlock = json.loads((tmp_dir / "rwlock").read_text() or "{}")
    except (OSError, ValueError):
        rwlock = {}
    infos = [*(rwlock.get("write") or {}).values(), *(i for v in (rwlock.get("read") or {}).values() for i in v)]
    for info in infos:
        if isinstance(info, dict) and isinstance(info.get("pid"), int) and (who := holder(info["pid"])):
            return who
    hardlink = bool(Config(dvc_dir=str(tmp_dir.parent))["core"].get("hardlink_lock", False))
    lock = make_lock(str(tmp_dir / "lock"), tmp_dir=str(tmp_dir), hardlink_lock=hardlink)
    try:
        lock.lock()  # DVC's own retries (about 3 s): someone's short `dvc status` passes
    except LockError:
        try:
            return holder(int((tmp_dir / "lock").read_text().split()[0])) or "another DVC process"
        except (OSError, ValueError, IndexError):
            return "another DVC process"
    lock.unlock()
    return None


@contextlib.contextmanager
def edit_yaml(path: Path) -> Iterator[Any]:
    """The YAML document at `path` as a mutable mapping, written back on exit with its comments and key order."""
    from dvc.utils.serialize import modify_yaml

    with modify_yaml(str(path)) as document:
        yield document


def set_params(params_file: Path, overrides: Sequence[str]) -> None:
    """`key=value` overrides written into params.yaml as `dvc exp run -S` writes them (other bytes kept)."""
    from dvc.utils.hydra import apply_overrides

    apply_overrides(str(params_file), list(overrides))


def cpu_native_bf16() -> bool:
    """Does this CPU do bf16 arithmetic natively (AVX-512 BF16 or AMX), rather than emulating it?"""
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


# DVC's public Python API, kept beside the private pieces so that every in-process use of DVC is here.


def dvc_remotes(path: Path) -> tuple[dict[str, str], str | None]:
    """The repository's configured DVC remotes (name -> url) and the default one's name (None: none set)."""
    from dvc.repo import Repo

    with Repo(str(path)) as repo:
        config = repo.config
        remotes = {name: str(section.get("url", "")) for name, section in config.get("remote", {}).items()}
        return remotes, config.get("core", {}).get("remote")


def dvc_stage_status(path: Path, stage: str) -> list[Any]:
    """`dvc status <stage>`'s entries for one stage (its upstream stages not included), as `--json` prints
    them; waits while another DVC process holds the repository lock (evaluate and export side by side)."""
    with dvc_repo(path) as repo:  # addressed by its dvc.yaml: a bare name would resolve from the working directory
        found = repo.status(targets=[f"{Path(path).resolve() / 'dvc.yaml'}:{stage}"])
    return next(iter(found.values()), [])


def dvc_stale_stages(path: Path) -> dict[str, list[str]]:
    """Every stage that `dvc status` says is not what dvc.lock records, as one line per reason:
    {"train": ["changed outs: models/model.pt (deleted)", "changed deps: params.yaml (train.lr)"]}. An
    `always changed` stage (the environment check, the gate) counts only for what else changed about it.
    {} means the workspace holds exactly the run dvc.lock records."""
    with dvc_repo(path) as repo:
        found = repo.status()
    stale: dict[str, list[str]] = {}
    for name, entries in found.items():
        stage = name.rsplit(":", 1)[-1]
        lines = []
        for entry in entries:
            if entry == "always changed" or not isinstance(entry, dict):
                continue
            for kind, what in entry.items():
                if isinstance(what, dict):
                    items = [f"{p} ({_status_detail(d)})" for p, d in what.items()]
                    lines.append(f"{kind}: {', '.join(items)}")
                else:
                    lines.append(f"{kind}: {what}")
        if lines:
            stale[stage] = lines
    return stale


def _status_detail(detail: Any) -> str:
    if isinstance(detail, dict):  # a params file: {key: "modified" | "new" | "deleted"}
        return ", ".join(f"{key} {state}" for key, state in detail.items())
    return str(detail)
