"""A running server's runtime folder, `<paths.runs>/serve/<port>/`, shared by its uvicorn workers: the reload
token (mode 0600, new at each start), the reload generation, each worker's report of what it serves, and room
for more (`path(name)`). `python -m serving` makes it afresh and holds its lock; `make reload` reads the token."""

from __future__ import annotations

import contextlib
import fcntl
import hmac
import json
import os
import secrets
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tasks.core.io import atomic_file
from tasks.core.paths import Paths

MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's multiprocess folder: `python -m serving` sets it
RUNTIME_ENV = "IMAGEPIPE_SERVE_RUNTIME"  # the folder, from `python -m serving` to the workers uvicorn spawns
TOKEN = "token"  # the reload token: a request to POST /reload carries it as `Authorization: Bearer <token>`
GENERATION = "generation"  # how many reloads were asked since start; each worker follows it
LOCK = "server.lock"  # flock-ed by the server owning the folder for as long as it runs; holds its pid
WORKERS = "workers"  # <pid>.json per worker: a WorkerReport
SHARED = "shared"  # the blocks the workers map: drift windows, the review count (serving/shared_memory.py)
METRICS = "prometheus"  # prometheus_client's multiprocess folder: each worker's counters, summed by /metrics


def runtime_folder(paths: Paths, port: int) -> Path:
    """The runtime folder of the server on `port` (runs/ is not versioned)."""
    return paths.runs / "serve" / str(port)


class RuntimeFolderError(RuntimeError):
    """The runtime folder is another server's, or not a server's at all."""


@dataclass(frozen=True)
class WorkerReport:
    pid: int
    generation: int | None  # the last reload generation this worker carried out; None while it first loads
    model: dict[str, Any] | None  # the ModelInfo it serves (None: no model loaded)
    error: str | None  # why its last load or reload failed (it then serves what it served before)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class ServerRuntime:
    """One server's runtime folder; `start` (the server process) or `attach` (a uvicorn worker) it."""

    def __init__(self, folder: Path, token: str, lock_fd: int | None = None) -> None:
        self.folder = folder
        self._token = token
        self._lock_fd = lock_fd  # held by the owner only

    @classmethod
    def start(cls, folder: Path) -> ServerRuntime:
        """The folder emptied and made again for this server: a new token, generation 0, no workers.

        Refused (RuntimeFolderError) while another live server holds it; a crashed one's lock is gone with it."""
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o700)
        fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RuntimeFolderError(f"{folder}: in use by another server (pid {holder}); stop it, or give this "
                                     "one another serve.port") from None  # fmt: skip
        for entry in folder.iterdir():  # a previous server's token, generation and reports
            if entry.name == LOCK:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        token = secrets.token_hex(32)
        tmp = folder / f".{TOKEN}.tmp-{os.getpid()}"
        tmp_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others, not even once
        with os.fdopen(tmp_fd, "w") as handle:
            handle.write(token + "\n")
        os.replace(tmp, folder / TOKEN)
        (folder / WORKERS).mkdir()
        runtime = cls(folder, token, fd)
        runtime._write_generation(0)
        return runtime

    @classmethod
    def attach(cls, folder: Path) -> ServerRuntime:
        """The folder the server process made (RuntimeFolderError when it has no token)."""
        try:
            token = (folder / TOKEN).read_text().strip()
        except OSError as exc:
            start = "start the server with `python -m serving` (make serve), which writes it"
            raise RuntimeFolderError(
                f"{folder / TOKEN}: cannot read the reload token ({type(exc).__name__}); {start}"
            ) from None
        return cls(folder, token)

    def close(self) -> None:
        """The owner's last act: the folder removed (make reload then says no server runs), the lock let go."""
        if self._lock_fd is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            os.close(self._lock_fd)
            self._lock_fd = None

    @property
    def token_file(self) -> Path:
        return self.folder / TOKEN

    def token_matches(self, candidate: str) -> bool:
        return hmac.compare_digest(candidate.encode(), self._token.encode())  # constant time: no timing oracle

    @property
    def shared(self) -> Path:
        return self.folder / SHARED

    @property
    def metrics(self) -> Path:
        return self.folder / METRICS

    def path(self, name: str) -> Path:
        """A file or folder of this server's own (one name per use), removed with the runtime folder."""
        return self.folder / name

    # -- the reload generation ------------------------------------------------------------------
    def generation(self) -> int:
        return int((self.folder / GENERATION).read_text())

    def bump(self) -> int:
        """The generation plus one, returned: every worker reloads once it sees it. Two reloads asked at once
        get two generations (read and write under a lock), so neither is answered by the other's files."""
        with open(self.folder / f"{GENERATION}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            generation = self.generation() + 1
            self._write_generation(generation)
        return generation

    def _write_generation(self, generation: int) -> None:
        with atomic_file(self.folder / GENERATION, "w", durable=False) as handle:  # polled: never half-written
            handle.write(f"{generation}\n")

    # -- worker reports -------------------------------------------------------------------------
    def report(self, report: WorkerReport) -> None:
        if not (self.folder / WORKERS).is_dir():  # the server closed the folder: not made again for one report
            return
        with atomic_file(self.folder / WORKERS / f"{report.pid}.json", "w", durable=False) as handle:
            json.dump(asdict(report), handle)

    def forget(self, pid: int) -> None:
        with contextlib.suppress(OSError):
            (self.folder / WORKERS / f"{pid}.json").unlink()

    def reports(self) -> list[WorkerReport]:
        """The live workers' reports, by pid; a dead worker's is removed (uvicorn starts another in its place,
        which loads the production model as it is on disk then)."""
        found = []
        for path in sorted((self.folder / WORKERS).glob("*.json")):
            try:
                report = WorkerReport(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError):  # removed meanwhile, or not ours
                continue
            if _pid_alive(report.pid):
                found.append(report)
            else:
                self.forget(report.pid)
        return sorted(found, key=lambda r: r.pid)
