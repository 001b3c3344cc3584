"""The MLflow side of the experiment table: a client for a tracking URI, the project's experiment, and one
record written as one run (params and metrics in batches of 100, the history as metric steps, the artifacts).
tasks/release/run_record.py decides what a record is, tasks/release/tracking.py when to write it."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ARTIFACTS_DIR = "mlartifacts"
KEY_TAG = "imagepipe.record_key"


def sqlite_file(uri: str) -> Path | None:
    """The database file of a SQLite tracking URI (`sqlite:///relative.db`, `sqlite:////absolute.db`); None for
    any other store."""
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


@contextmanager
def writing(uri: str) -> Iterator[None]:
    """Held while writing a SQLite store: one writer at a time across threads and processes (a gate, promote, the
    nightly, a sweep's trials), by an flock on `<database>.lock` beside the database (the first writers of a new
    store race to create its tables). The kernel frees it when its holder dies. Not reentrant: hold it around
    one write. A tracking server takes concurrent writers itself: no lock."""
    db = sqlite_file(uri)
    if db is None:
        yield
        return
    lock = db.with_name(db.name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as handle:  # a file of its own: never the database, whose locks SQLite holds
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _artifact_location(uri: str) -> str | None:
    """For a SQLite store, artifacts go beside it (not into the working directory, which may be a temp copy)."""
    db = sqlite_file(uri)
    return (db.parent / ARTIFACTS_DIR).resolve().as_uri() if db is not None else None


@dataclass
class Record:
    """One pipeline run as MLflow sees it."""

    key: str
    name: str
    params: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)
    artifacts: list[Path] = field(default_factory=list)
    started: int | None = None  # ms since the epoch: when the run's first stage that ran began (None: now)


@contextmanager
def quiet_http() -> Iterator[None]:
    """A remote store that does not answer: fail in seconds, not after MLflow's minutes of retries."""
    saved = {k: os.environ.get(k) for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")}
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)


def client(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def experiment_id(mlflow_client: Any, name: str, uri: str) -> str:
    found = mlflow_client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    # A model-training experiment: MLflow's UI opens it on the runs table, not on its GenAI traces overview
    tags = {"mlflow.experimentKind": "custom_model_development"}
    return mlflow_client.create_experiment(name, artifact_location=_artifact_location(uri), tags=tags)


def find_run(mlflow_client: Any, exp_id: str, key: str) -> str | None:
    runs = mlflow_client.search_runs([exp_id], filter_string=f"tags.`{KEY_TAG}` = '{key}'", max_results=1)
    return runs[0].info.run_id if runs else None


def log_record(record: Record, uri: str, experiment: str, *, parent: str | None = None) -> tuple[str, bool]:
    """(run id, whether it is new): the run already logged under the record's key, or a new one."""
    from mlflow.entities import Metric, Param

    mlflow_client = client(uri)
    exp_id = experiment_id(mlflow_client, experiment, uri)
    existing = find_run(mlflow_client, exp_id, record.key)
    if existing:
        return existing, False
    tags = dict(record.tags)
    if parent:
        tags["mlflow.parentRunId"] = parent
    run = mlflow_client.create_run(exp_id, run_name=record.name, tags=tags, start_time=record.started)
    run_id = run.info.run_id
    params = [Param(k, v[:6000]) for k, v in record.params.items()]
    now = run.info.start_time
    metrics = [Metric(k, v, now, 0) for k, v in record.metrics.items()]
    for row in record.history:
        step = int(row.get("epoch", 0))
        metrics += [
            Metric(k, float(v), now, step) for k, v in row.items() if k != "epoch" and isinstance(v, (int, float))
        ]
    for i in range(0, max(len(params), len(metrics)), 100):  # MLflow takes at most 100 params per batch
        mlflow_client.log_batch(run_id, metrics=metrics[i : i + 100], params=params[i : i + 100])
    for path in record.artifacts:
        mlflow_client.log_artifact(run_id, str(path), artifact_path="reports")
    mlflow_client.set_terminated(run_id, "FINISHED" if record.metrics.get("gate_passed", 0.0) else "FAILED")
    return run_id, True
