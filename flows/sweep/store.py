"""The project's MLflow store during a sweep: one writer at a time.

A trial's gate logs its run from inside `dvc exp run`, in a process of the trial's own. With the project's store
a SQLite file (the default, mlflow.db), parallel trials and a second study's sweep would all write that one
file at once, and the first writers of a new store race to create its tables (measured: of two sweeps starting
together on a new store, one failed, 3 times of 3: "duplicate column name" or an Alembic migration error). So:
- each trial's gate logs into a store of its own, in the trial's folder (`for_trial`, its MLFLOW_TRACKING_URI);
- when the trial ends, the sweep copies what that store holds into the project's (`merge`): each run with its
  params, every metric's history, its tags (the sweep's parent among them), artifacts, status and times; a run
  whose record key the project's store has already is not copied twice, as the gate would not log it twice;
- every write of a sweep to the project's store (the parent run, a pruned or failed trial, a merge, the
  comparison) holds the store's writer lock (tasks/release/mlflow_store.writing, `<database>.lock`), as every
  gate, promote and nightly does: the trials' threads, another study's sweep and a `make run` write one at a
  time. The kernel frees the lock when its holder dies.
Another tracking server takes concurrent writers itself: there the trials' gates write to it directly.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.release import mlflow_store

log = logging.getLogger(__name__)

BATCH = 100  # MLflow takes at most 100 params (and 1000 metrics) per log_batch


@dataclass(frozen=True)
class Store:
    """The project's tracking URI (its writers share mlflow_store.writing's lock)."""

    uri: str

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Held while writing the project's store: one writer at a time, across threads and processes."""
        with mlflow_store.writing(self.uri):
            yield

    def for_trial(self, folder: Path) -> str | None:
        """The tracking URI for a trial's gate: a SQLite store in `folder` when the project's is a SQLite file;
        None (the project's own, written directly) for a tracking server."""
        if mlflow_store.sqlite_file(self.uri) is None:
            return None
        folder.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{(folder / 'mlflow.db').resolve()}"

    def merge(self, trial_uri: str) -> list[str]:
        """Every run of the trial's store, copied into the project's under the lock. Returns the new run ids;
        a failure is one warning line (the trial's record, dvc.lock and reports/, is complete without it)."""
        db = mlflow_store.sqlite_file(trial_uri)
        if db is None or not db.is_file():  # the gate logged nothing (tracking off, or the trial never got there)
            return []
        try:
            source, target = mlflow_store.client(trial_uri), mlflow_store.client(self.uri)
            copied = []
            with self.writing():
                for experiment in source.search_experiments():
                    runs = source.search_runs([experiment.experiment_id])
                    if not runs:
                        continue
                    exp_id = mlflow_store.experiment_id(target, experiment.name, self.uri)
                    for run in runs:
                        key = run.data.tags.get(mlflow_store.KEY_TAG)
                        if key and mlflow_store.find_run(target, exp_id, key):
                            continue
                        copied.append(_copy_run(source, target, exp_id, run))
            return copied
        except Exception as exc:  # noqa: BLE001 - the table mirrors the record; it never fails the sweep
            text = str(exc).strip()
            log.warning("warning: MLflow runs of %s not copied into %s (%s: %s); the sweep goes on", trial_uri,
                        self.uri, type(exc).__name__, text.splitlines()[0][:300] if text else "")  # fmt: skip
            return []


def _copy_run(source: Any, target: Any, exp_id: str, run: Any) -> str:
    from mlflow.entities import Param

    info, data = run.info, run.data
    tags = {k: v for k, v in data.tags.items() if k != "mlflow.runName"}  # run_name sets it
    new = target.create_run(exp_id, start_time=info.start_time, tags=tags, run_name=info.run_name).info.run_id
    params = [Param(k, v) for k, v in data.params.items()]
    metrics = [m for key in data.metrics for m in source.get_metric_history(info.run_id, key)]
    for i in range(0, max(len(params), len(metrics)), BATCH):
        target.log_batch(new, metrics=metrics[i : i + BATCH], params=params[i : i + BATCH])
    if source.list_artifacts(info.run_id):
        with tempfile.TemporaryDirectory() as scratch:
            target.log_artifacts(new, source.download_artifacts(info.run_id, "", scratch))
    target.set_terminated(new, info.status, end_time=info.end_time)
    return new
