"""A real PostgreSQL for tests: a cluster of its own (initdb) in a temporary folder, on a free local port.

The system's server binaries (initdb, pg_ctl, postgres on PATH or under /usr/lib/postgresql/*/bin) are used;
PostgreSQL refuses to run as root, so as root the cluster belongs to the `postgres` system user and its commands
run through `runuser`. `postgres_server()` skips the test, with the reason, when no server can start.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.prefect import free_port

USER = "imagepipe"


def _binaries() -> Path | None:
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(versions[-1]).parent if versions else None


def _as_owner(command: list[str], owner: str | None) -> list[str]:
    return ["runuser", "-u", owner, "--", *command] if owner else command


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """A started server; yields its SQLAlchemy URL (database `postgres`, user imagepipe, no password needed)."""
    bindir = _binaries()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (pg_ctl): apt-get install postgresql")
    owner = None
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no `postgres` user to own a PostgreSQL cluster")
        owner = "postgres"
    folder = Path(tempfile.mkdtemp(prefix="imagepipe-pg-"))
    data, port = folder / "data", free_port()
    if owner:
        shutil.chown(folder, user=owner)
    try:
        init = subprocess.run(_as_owner([str(bindir / "initdb"), "-D", str(data), "-U", USER, "-A", "trust",
                                         "--no-sync", "-E", "UTF8"], owner),
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        if init.returncode != 0:
            pytest.skip(f"initdb failed: {init.stderr.strip()[-300:]}")
        options = f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=100"
        start = subprocess.run(_as_owner([str(bindir / "pg_ctl"), "-D", str(data), "-o", options, "-l",
                                          str(folder / "log"), "-w", "-t", "60", "start"], owner),
                               capture_output=True, text=True, timeout=120)  # fmt: skip
        if start.returncode != 0:
            log = (folder / "log").read_text()[-300:] if (folder / "log").is_file() else start.stderr
            pytest.skip(f"PostgreSQL did not start: {log.strip()}")
        yield f"postgresql://{USER}@127.0.0.1:{port}/postgres"
    finally:
        if (data / "postmaster.pid").is_file():
            subprocess.run(_as_owner([str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                                     owner), capture_output=True, timeout=60)  # fmt: skip
        time.sleep(0.1)
        shutil.rmtree(folder, ignore_errors=True)
