"""MLflow as the experiment table; DVC stays the record. This module decides when and where a record is written.

Every pipeline run that reaches the gate (check_regression, pass or fail) becomes one MLflow run, keyed by
what identifies the model and its scores (tasks/release/run_record.py says what a record holds): a no-op rerun,
or a `dvc repro` that enforces the verdict an experiment recorded, finds its key already logged and adds nothing.
`make promote` registers the promoted ONNX as a version of a registered model with the alias `production` (the
registry mirrors baseline/; it never decides).

The store is MLflow's own default, `mlflow.db` (SQLite) beside the project, unless MLFLOW_TRACKING_URI names
another. A store that cannot be reached or read costs one warning line, never the run: `mirror` catches
everything, and the record (dvc.lock, reports/) is complete without it.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tasks.core.io import read_json, write_json
from tasks.core.params import Params
from tasks.release.mlflow_store import Record, client, log_record, quiet_http, sqlite_file, writing
from tasks.release.run_record import gather, nightly_record

log = logging.getLogger(__name__)

DB_FILE = "mlflow.db"
PARENT_ENV = "IMAGEPIPE_MLFLOW_PARENT"  # the sweep's parent run: its trials' runs become its children
PRODUCTION_ALIAS = "production"
REGISTRY_NOTE = "the promoted ONNX model (make promote); baseline/ and DVC hold the truth, this mirrors them"
_TEMP_EXPERIMENT = re.compile(r"^(.*?)/\.dvc/tmp/exps/[^/]+")  # `dvc exp run --temp` runs in such a copy


def project_root(cwd: Path | None = None) -> Path:
    """The project this run belongs to: the working directory, or the repository a DVC temp copy lives in."""
    here = (cwd or Path.cwd()).resolve()
    match = _TEMP_EXPERIMENT.match(here.as_posix())
    return Path(match.group(1)) if match else here


def tracking_uri(root: Path) -> str:
    """MLFLOW_TRACKING_URI when set, else MLflow's default store: SQLite `mlflow.db` beside the project.

    A relative SQLite store in MLFLOW_TRACKING_URI (`sqlite:///mlflow.db`) is taken relative to the project,
    not to the folder a stage runs in: a `dvc exp run --temp` copy or a sweep trial would otherwise write a
    store of its own that is deleted with the copy."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return f"sqlite:///{(root / DB_FILE).resolve()}"
    db = sqlite_file(uri)
    if db is not None and not db.is_absolute() and db.name != ":memory:":
        return f"sqlite:///{(root / db).resolve()}"
    return uri


def nightly(
    p: Params, root: Path, metrics: dict[str, Any], verdict: str, passed: bool, onnx_sha256: str,
    flow_run: tuple[str, str] | None = None,
) -> str | None:  # fmt: skip
    """regression-flow's check of the production model as one run (run_record.nightly_record). One warning line
    when the store fails."""
    if _disabled(p):
        return None
    try:
        record = nightly_record(p, root, metrics, verdict, passed, onnx_sha256, flow_run)
        return _log(p, root, record)
    except Exception as exc:  # noqa: BLE001 - the table mirrors the record; it never fails the run
        _warn(tracking_uri(project_root(root)), exc)
        return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


def _read(path: Path) -> Any:
    return read_json(path) if path.is_file() else None


def _marker(p: Params, root: Path) -> Path:
    return root / p.paths.runs / "tracking" / "logged.json"


def _warn(uri: str, exc: BaseException) -> None:
    log.warning("warning: MLflow store %s not written (%s: %s); the run's record (dvc.lock, reports/) is complete "
                "without it", uri, type(exc).__name__, _first_line(exc))  # fmt: skip


def _log(p: Params, root: Path, record: Record) -> str:
    """The record's run id: the one logged already (this workspace's note, or the store's key), or a new one."""
    uri = tracking_uri(project_root(root))
    marker = _marker(p, root)
    known = (_read(marker) or {}).get(uri, {})
    db = sqlite_file(uri)
    if record.key in known and (db is None or db.is_file()):
        log.info("MLflow: this record is run %s in %s already (nothing changed)", known[record.key], uri)
        return known[record.key]
    with quiet_http(), writing(uri):
        run_id, new = log_record(record, uri, p.tracking.experiment, parent=os.environ.get(PARENT_ENV) or None)
    write_json(marker, {**(_read(marker) or {}), uri: {**known, record.key: run_id}})
    log.info("MLflow: %s run %s (%s) in %s; `make experiments` shows the table",
             "logged" if new else "this record is", run_id, record.name, uri)  # fmt: skip
    return run_id


def _disabled(p: Params) -> bool:
    if not p.tracking.enabled:
        log.info("MLflow: not logged (tracking.enabled is false in params.yaml)")
    return not p.tracking.enabled


def mirror(p: Params, root: Path | None = None) -> str | None:
    """Log this run's record as one MLflow run, once; one warning line when the store fails. Returns the run id
    (None: not logged, with tracking.enabled false or a failed store)."""
    root = root or Path.cwd()
    if _disabled(p):
        return None
    try:
        return _log(p, root, gather(p, root))
    except Exception as exc:  # noqa: BLE001 - the table mirrors the record; it never fails the run
        _warn(tracking_uri(project_root(root)), exc)
        return None


def register_production(p: Params, onnx: Path, onnx_sha256: str, tags: Mapping[str, str] | None = None,
                        root: Path | None = None) -> str | None:  # fmt: skip
    """The promoted ONNX as a version of tracking.registered_model, alias `production`, with `tags` (the
    promotion's decision: who, when, why, the verdict set aside) set on the version. One warning on failure."""
    root = root or Path.cwd()
    uri = tracking_uri(project_root(root))
    try:
        with quiet_http():
            run_id = mirror(p, root)
            if run_id is None:
                return None
        with quiet_http(), writing(uri):  # after mirror, which holds it for its own write
            mlflow_client = client(uri)
            name = p.tracking.registered_model
            if not mlflow_client.search_registered_models(f"name = '{name}'"):
                mlflow_client.create_registered_model(name, description=REGISTRY_NOTE)
            versions = mlflow_client.search_model_versions(f"name = '{name}'")
            same = [v for v in versions if v.tags.get("onnx_sha256") == onnx_sha256]
            if same:
                version = same[0].version
            else:
                mlflow_client.log_artifact(run_id, str(onnx), artifact_path="model")
                source = f"{mlflow_client.get_run(run_id).info.artifact_uri}/model/{onnx.name}"
                version = mlflow_client.create_model_version(
                    name, source, run_id=run_id, tags={"onnx_sha256": onnx_sha256}
                ).version
            # The latest decision replaces an earlier one's on a version promoted twice: a `decision.*` tag it does
            # not set (a reason, after a promotion that needed none) goes.
            stale = [k for k in mlflow_client.get_model_version(name, version).tags
                     if k.startswith("decision.") and k not in (tags or {})]  # fmt: skip
            for key in stale:
                mlflow_client.delete_model_version_tag(name, version, key)
            for key, value in (tags or {}).items():
                mlflow_client.set_model_version_tag(name, version, key, value)
            mlflow_client.set_registered_model_alias(name, PRODUCTION_ALIAS, version)
        log.info("MLflow registry: %s version %s is now alias '%s' (run %s)", name, version, PRODUCTION_ALIAS, run_id)
        return str(version)
    except Exception as exc:  # noqa: BLE001
        log.warning(
            "warning: MLflow registry %s not updated (%s: %s); baseline/ is promoted all the same",
            uri,
            type(exc).__name__,
            _first_line(exc),
        )
        return None
