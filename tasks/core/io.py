"""Atomic file and directory writes, hashing, and deterministic JSON.

A stage writes its outputs to a temporary sibling and renames it into place only when it is
complete, so a crash mid-run never leaves an output that looks finished.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def dead_writers_temps(final: Path, kinds: tuple[str, ...] = ("tmp", "old")) -> list[Path]:
    """The `.<name>.<kind>-<pid>[-...]` siblings of `final` whose writer (that pid) is dead, in name order."""
    final = Path(final)
    prefix, found = f".{final.name}.", []
    for path in sorted(final.parent.iterdir()) if final.parent.is_dir() else ():
        if not path.name.startswith(prefix):
            continue
        kind, _, owner = path.name[len(prefix) :].partition("-")
        pid = owner.split("-")[0]  # <pid> or <pid>-<thread>
        if kind in kinds and pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            found.append(path)
    return found


def remove_stale_temps(final: Path) -> list[Path]:
    """Remove `.<name>.tmp-<pid>` / `.<name>.old-<pid>` siblings left by a killed writer (dead pid).

    A writer killed with SIGKILL never reaches its cleanup; the next writer of the same output
    removes what it left. Temps of a live process (a concurrent writer) are left alone.
    """
    removed = []
    for path in dead_writers_temps(final):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


@contextlib.contextmanager
def atomic_dir(final: Path, *, keep_on_error: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory that replaces `final` when the block succeeds. `keep_on_error`: a
    block that raises leaves the directory (hidden, never `final`) for the next writer to take what it can."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(final)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        if not keep_on_error:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists() and _exchange(tmp, final):
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the previous output
    else:
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        if final.exists():
            final.rename(old)  # not atomic: a kill here leaves no `final` until the next run
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(final.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where unsupported.

    Replacing a directory by rename-away-then-rename-in leaves a moment with neither; a SIGKILL
    there would lose the previous complete output.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


@contextlib.contextmanager
def atomic_path(
    final: Path, *, durable: bool = True, before_commit: Callable[[Path], None] | None = None
) -> Iterator[Path]:
    """A temporary path beside `final` to write; on success it is fsynced and renamed over `final`: the one
    way this project writes a file that must never be seen half-written (outputs, checkpoints, the ONNX
    model once its checks pass, served intake). Raise in the block and `final` is left as it was.

    `durable=False` skips the fsyncs (a review folder's intake: atomic, not crash-durable);
    `before_commit(tmp)` runs between the write and the rename (the fault tests kill a save there).
    The temporary name carries the pid and thread, so concurrent writers of one path never collide."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(final)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        yield tmp
        if durable:
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
        if before_commit is not None:
            before_commit(tmp)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(final.parent)


@contextlib.contextmanager
def atomic_file(
    final: Path, mode: str = "wb", *, durable: bool = True, before_commit: Callable[[Path], None] | None = None
) -> Iterator[Any]:
    """`atomic_path`, opened: write to the handle; on success the file replaces `final`."""
    with atomic_path(final, durable=durable, before_commit=before_commit) as tmp, open(tmp, mode) as handle:
        yield handle


def dumps_json(obj: Any) -> str:
    """Deterministic JSON: sorted keys, fixed indentation, trailing newline."""
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def write_json(path: Path, obj: Any) -> None:
    with atomic_file(path, "w") as handle:
        handle.write(dumps_json(obj))


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    return sha256_and_size(path, chunk)[0]


def sha256_and_size(path: Path, chunk: int = 1 << 20) -> tuple[str, int]:
    """The file's sha256 and its size in bytes, streamed. os.open/os.read: a buffered file object
    adds four system calls per file, which is most of the cost for 10,000 small images."""
    digest, size = hashlib.sha256(), 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while block := os.read(fd, chunk):
            digest.update(block)
            size += len(block)
    finally:
        os.close(fd)
    return digest.hexdigest(), size
