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


def runs_table_url(params: Params, uri: str) -> str | None:
    """The UI's address of the project's runs table (tracking.experiment), or None while the store has no such
    experiment. MLflow 3 opens its home address on the GenAI overview, not on any experiment's runs."""
    with mlflow_store.quiet_http():
        found = mlflow_store.client(uri).get_experiment_by_name(params.tracking.experiment)
    if found is None:
        return None
    return f"http://127.0.0.1:{params.tracking.ui_port}/#/experiments/{found.experiment_id}/runs"


def _main(params: Params) -> None:
    args = command(params, Path.cwd())
    if args is None:
        log.info(
            "the experiment table is on the tracking server MLFLOW_TRACKING_URI=%s: open that address in a "
            "browser (make experiments starts a UI only over a local store)",
            tracking.tracking_uri(Path.cwd()),
        )
        return
    uri = args[5]
    url = runs_table_url(params, uri)
    if url is None:
        log.info("MLflow UI on http://127.0.0.1:%d over %s (Ctrl-C stops it); it has no experiment %r yet "
                 "(tracking.experiment in params.yaml): the first run that reaches the gate creates it",
                 params.tracking.ui_port, uri, params.tracking.experiment)  # fmt: skip
    else:
        log.info("the runs table of experiment %r: %s (MLflow UI over %s; Ctrl-C stops it)",
                 params.tracking.experiment, url, uri)  # fmt: skip
    sys.stdout.flush()
    os.execv(args[0], args)


def main() -> None:
    stage_main("experiments", _main)


if __name__ == "__main__":
    main()
