"""State every uvicorn worker of a server shares: blocks of numbers in files of the server's runtime folder
(serving/runtime.py), each mapped by every worker and guarded by a file lock.

The drift window of the served model (one block per model, by its sha256) and the review folder's count live
here, so /drift, /metrics and the review limit are the server's, whichever worker answers. A block is made
zeroed by the first worker to open it (an empty window, a count of nothing), under the file's lock (a block
whose opener died before its header was written is made again); one with another layout is refused, naming
the file. `close` gives back the mapping and the descriptor. flock is the process's side of the lock, a thread lock the
threads' (flock is per open file, which a process's streams share); both are held for microseconds.
bench/bench_serving.py measures what they cost per prediction.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
from contextlib import AbstractContextManager
from pathlib import Path

from tasks.release.window_memory import CELL, Layout, fingerprint, layout_size, views


class SharedBlockError(RuntimeError):
    """A block file that is not the layout asked for: one line naming it."""


class SharedFile:
    """One block in `path`, shared by every process that opens it (WindowMemory, tasks/release/window_memory.py)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._thread_lock = threading.Lock()
        self._fd: int | None = None
        self._map: mmap.mmap | None = None

    def open(self, layout: Layout) -> dict[str, memoryview]:
        size = CELL + layout_size(layout)  # a header cell: the layout's fingerprint
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                found = os.fstat(fd).st_size
                # The first opener: a zeroed block is an empty state. So is one whose size is set and whose header
                # is still zero: an opener killed between the two writes (a layout's fingerprint is never zero).
                if found == 0 or (found == size and os.pread(fd, CELL, 0) == bytes(CELL)):
                    os.ftruncate(fd, size)
                    os.pwrite(fd, fingerprint(layout), 0)
                elif found != size or os.pread(fd, CELL, 0) != fingerprint(layout):
                    raise SharedBlockError(f"{self.path}: a shared block of {found} bytes with another layout than "
                                           f"this worker's ({size} bytes); is another server's runtime folder "
                                           "in use?")  # fmt: skip
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._views = [memoryview(self._map)[CELL:]]
        arrays = views(self._views[0], layout)
        self._views += arrays.values()
        return arrays

    def close(self) -> None:
        """Unmap the block and close its descriptor (a reload's old window, or one it did not need): the views
        handed out are released first, as mmap requires. The file stays for the other workers."""
        with self._thread_lock:
            for view in getattr(self, "_views", ()):
                view.release()
            self._views = []
            if self._map is not None:
                self._map.close()
                self._map = None
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def lock(self) -> AbstractContextManager[object]:
        assert self._fd is not None, "open the block first"
        return _BlockLock(self)


class _BlockLock:
    """The threads' lock, then the processes' (flock): a class, not a generator, since add() takes it per
    prediction. Once the block is closed it is the threads' lock alone (the window's user then does nothing)."""

    def __init__(self, block: SharedFile) -> None:
        self._block = block
        self._fd: int | None = None

    def __enter__(self) -> None:
        self._block._thread_lock.acquire()
        try:
            self._fd = self._block._fd  # None: closed meanwhile, under this same thread lock
            if self._fd is not None:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._block._thread_lock.release()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            if self._fd is not None:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._block._thread_lock.release()
