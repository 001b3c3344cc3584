"""`make experiments`: the MLflow UI over this project's experiment table, on 127.0.0.1:<tracking.ui_port>, offline.

The store is the one the stages log to (tasks/release/tracking.py): MLFLOW_TRACKING_URI when set, else
mlflow.db beside the project. Every run that reached the gate is a row, with its params, metrics and lineage
tags (git.commit, data.manifest_sha256, env.precision, prefect.flow_run_url, ...); a sweep is a parent run with
its trials as children; make promote's model is the registry's alias `production`. Ctrl-C stops it.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path

from tasks.core.cli import stage_main
from tasks.core.errors import StageError
from tasks.core.params import Params
from tasks.release import mlflow_store, tracking

log = logging.getLogger(__name__)


def command(params: Params, root: Path) -> list[str] | None:
    """The `mlflow ui` command line over this project's store; None when the store is a tracking server, which
    serves its own UI."""
    uri = tracking.tracking_uri(root)
    if uri.startswith(("http://", "https://", "databricks")):
        return None
    db = mlflow_store.sqlite_file(uri)
    if db is not None and not db.is_file():
        raise StageError(f"no experiment table yet: {db} does not exist; it is written by the first run that "
                         "reaches the gate (make run)")  # fmt: skip
    port = params.tracking.ui_port
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            raise StageError(f"port {port} on 127.0.0.1 is taken (tracking.ui_port in params.yaml): stop what "
                             "listens there, or change the port")  # fmt: skip
    return [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", "127.0.0.1",
            "--port", str(port), "--workers", "1"]  # fmt: skip


def _main(params: Params) -> None:
    args = command(params, Path.cwd())
    if args is None:
        log.info(
            "the experiment table is on the tracking server MLFLOW_TRACKING_URI=%s: open that address in a "
            "browser (make experiments starts a UI only over a local store)",
            tracking.tracking_uri(Path.cwd()),
        )
        return
    log.info("MLflow UI on http://127.0.0.1:%d over %s (Ctrl-C stops it)", params.tracking.ui_port, args[5])
    sys.stdout.flush()
    os.execv(args[0], args)


def main() -> None:
    stage_main("experiments", _main)


if __name__ == "__main__":
    main()
