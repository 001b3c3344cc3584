"""MLflow as the experiment table; DVC stays the record.

Every pipeline run that reaches the gate (check_regression, pass or fail) becomes one MLflow run, keyed by
the record's output hashes: a no-op rerun finds its key already logged and adds nothing. A run carries
params.yaml flattened (the names `dvc exp show` uses), the test metrics, the export gates and latencies, the
verdict, the per-epoch history as metric steps, the lineage as tags (git commit and dirtiness, DVC experiment,
data manifest and test-set sha256, precision, CPU and torch from the environment record, the Prefect flow run)
and the reports people look at as artifacts. `make promote` registers the promoted ONNX as a version of a
registered model with the alias `production` (the registry mirrors baseline/; it never decides).

The store is MLflow's own default, `mlflow.db` (SQLite) beside the project, unless MLFLOW_TRACKING_URI names
another. A store that cannot be reached or read costs one warning line, never the run: `mirror` catches
everything, and the record (dvc.lock, reports/) is complete without it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tasks.core.environment import dvc_experiment
from tasks.core.io import read_json, sha256_file, write_json
from tasks.core.nested import flatten
from tasks.core.params import PARAMS_FILE, Params

log = logging.getLogger(__name__)

DB_FILE = "mlflow.db"
ARTIFACTS_DIR = "mlartifacts"
KEY_TAG = "imagepipe.record_key"
PARENT_ENV = "IMAGEPIPE_MLFLOW_PARENT"  # the sweep's parent run: its trials' runs become its children
TRIAL_ENV = "IMAGEPIPE_SWEEP_TRIAL"  # the sweep's trial number, a tag of the trial's run
FLOW_RUN_URL_ENV = "IMAGEPIPE_FLOW_RUN_URL"  # the Prefect flow run's page (flows/shell.py sets it for its stages)
PRODUCTION_ALIAS = "production"
REGISTRY_NOTE = "the promoted ONNX model (make promote); baseline/ and DVC hold the truth, this mirrors them"
_TEMP_EXPERIMENT = re.compile(r"^(.*?)/\.dvc/tmp/exps/[^/]+")  # `dvc exp run --temp` runs in such a copy


def project_root(cwd: Path | None = None) -> Path:
    """The project this run belongs to: the working directory, or the repository a DVC temp copy lives in."""
    here = (cwd or Path.cwd()).resolve()
    match = _TEMP_EXPERIMENT.match(here.as_posix())
    return Path(match.group(1)) if match else here


def tracking_uri(root: Path) -> str:
    """MLFLOW_TRACKING_URI when set, else MLflow's default store: SQLite `mlflow.db` beside the project."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(root / DB_FILE).resolve()}"


def _artifact_location(uri: str) -> str | None:
    """For a SQLite store, artifacts go beside it (not into the working directory, which may be a temp copy)."""
    if uri.startswith("sqlite:///"):
        return (Path(uri.removeprefix("sqlite:///")).parent / ARTIFACTS_DIR).resolve().as_uri()
    return None


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


def record_key(files: list[Path]) -> str:
    """sha256 over the record's outputs: the same outputs, the same key."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.as_posix()}\0{sha256_file(path) if path.is_file() else '-'}\n".encode())
    return digest.hexdigest()


def _metric_name(text: str) -> str:
    return re.sub(r"[^0-9A-Za-z_\-. /]", "_", text)


def _git(root: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def git_tags(root: Path, reports: Path) -> dict[str, str]:
    """The commit and whether code or params differ from it (what DVC writes after a run does not count)."""
    commit = (_git(root, "rev-parse", "HEAD") or "").strip()
    if not commit:
        return {"git.commit": "none"}
    status = _git(root, "status", "--porcelain", "--untracked-files=no") or ""
    changed = [line[3:] for line in status.splitlines() if line[3:] != "dvc.lock"]
    changed = [
        name for name in changed if not name.startswith(f"{reports.as_posix()}/") and not name.endswith(".gitignore")
    ]
    return {
        "mlflow.source.git.commit": commit,
        "git.commit": commit,
        "git.dirty": str(bool(changed)).lower(),
        **({"git.changed": " ".join(changed[:20])} if changed else {}),
    }


def test_set_sha256(manifest: dict[str, Any]) -> str:
    """The test split's identity: the sha256 of its shards' sha256s, in order."""
    shards = [entry["sha256"] for entry in manifest.get("splits", {}).get("test", {}).get("shards", [])]
    return hashlib.sha256("\n".join(shards).encode()).hexdigest()


def _read(path: Path) -> Any:
    return read_json(path) if path.is_file() else None


def gather(p: Params, root: Path) -> Record:
    """The record of the run in `root`, read from its reports (nothing is recomputed)."""
    paths = p.paths
    files = [paths.metrics, paths.export_report, paths.regression_json, paths.gate, paths.train_run]
    key = record_key([root / f for f in files])
    metrics = _read(root / paths.metrics) or {}
    export = _read(root / paths.export_report) or {}
    gate = _read(root / paths.gate) or {}
    timings = _read(root / paths.export_timings) or {}
    raw = yaml.safe_load((root / PARAMS_FILE).read_text()) or {}
    params = {
        k: json.dumps(v) if isinstance(v, (list, dict)) else "" if v is None else str(v)
        for k, v in flatten(raw).items()
    }
    out: dict[str, float] = {}
    for name in ("accuracy", "macro_f1", "macro_precision", "macro_recall", "loss"):
        if isinstance(metrics.get(name), (int, float)):
            out[f"test_{name}"] = float(metrics[name])
    for cls, row in (metrics.get("per_class") or {}).items():
        out[_metric_name(f"f1.{cls}")] = float(row["f1"])
    if "agreement" in export:
        out["onnx_agreement"] = float(export["agreement"])
        out["onnx_max_abs_diff"] = float(export.get("max_abs_diff", 0.0))
    int8 = export.get("onnx_int8") or {}
    for name in ("agreement", "accuracy", "accuracy_drop"):
        if isinstance(int8.get(name), (int, float)):
            out[f"int8_{name}"] = float(int8[name])
    for runtime, ms in ((timings.get("latency_ms_median") or {}).get("batch_1") or {}).items():
        if isinstance(ms, (int, float)):
            out[_metric_name(f"latency_ms_batch1.{runtime}")] = float(ms)
    if "passed" in gate:
        out["gate_passed"] = 1.0 if gate["passed"] else 0.0
    tags = {KEY_TAG: key, "gate.verdict": str(gate.get("verdict", "none")), **git_tags(root, paths.reports)}
    experiment = dvc_experiment()
    tags["dvc.experiment"] = experiment or ""
    prefect = os.environ.get("PREFECT__FLOW_RUN_ID")
    sweep = os.environ.get(TRIAL_ENV)
    tags["source"] = "make sweep" if sweep else "dvc exp run" if experiment else "prefect" if prefect else "dvc repro"
    manifest_path = root / paths.shards / "manifest.json"
    if manifest_path.is_file():
        tags["data.manifest_sha256"] = sha256_file(manifest_path)
        tags["data.test_sha256"] = test_set_sha256(read_json(manifest_path))
    tags["data.source"] = str(p.data.source)
    train_env = _read(root / paths.environment / "train.json") or {}
    tags["env.precision"] = str(train_env.get("precision", ""))
    tags["env.cpu"] = str((train_env.get("cpu") or {}).get("torch_capability", ""))
    tags["env.cpu_flags"] = " ".join((train_env.get("cpu") or {}).get("flags", []))
    tags["env.torch"] = str((train_env.get("libraries") or {}).get("torch", ""))
    tags["env.device"] = str(train_env.get("device", ""))
    if prefect:
        tags["prefect.flow_run_id"] = prefect
        api = os.environ.get("PREFECT_API_URL", "").removesuffix("/api")
        url = os.environ.get(FLOW_RUN_URL_ENV) or (f"{api.rstrip('/')}/runs/flow-run/{prefect}" if api else "")
        if url:
            tags["prefect.flow_run_url"] = url
    if sweep:
        tags["sweep.trial"] = sweep
        tags["sweep.state"] = "complete"
    history = _read(root / paths.train_history) or []
    artifacts = [root / f for f in (paths.confusion_png, paths.errors_gallery, paths.train_curves, paths.regression_md)]
    name = experiment or f"{tags['source'].replace(' ', '-')}-{key[:8]}"
    return Record(key, name, params, out, history, tags, [a for a in artifacts if a.is_file()])


@contextmanager
def _quiet_http() -> Iterator[None]:
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
    return mlflow_client.create_experiment(name, artifact_location=_artifact_location(uri))


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
    run = mlflow_client.create_run(exp_id, run_name=record.name, tags=tags)
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


def _marker(p: Params, root: Path) -> Path:
    return root / p.paths.runs / "tracking" / "logged.json"


def mirror(p: Params, root: Path | None = None) -> str | None:
    """Log this run's record as one MLflow run, once; one warning line when the store fails. Returns the run id."""
    root = root or Path.cwd()
    home = project_root(root)
    uri = tracking_uri(home)
    try:
        record = gather(p, root)
        marker = _marker(p, root)
        known = (_read(marker) or {}).get(uri, {})
        local_db = uri.startswith("sqlite:///") and Path(uri.removeprefix("sqlite:///")).is_file()
        if record.key in known and (local_db or not uri.startswith("sqlite:///")):
            log.info("MLflow: this record is run %s in %s already (nothing changed)", known[record.key], uri)
            return known[record.key]
        with _quiet_http():
            run_id, new = log_record(record, uri, p.tracking.experiment, parent=os.environ.get(PARENT_ENV) or None)
        write_json(marker, {**(_read(marker) or {}), uri: {**known, record.key: run_id}})
        log.info(
            "MLflow: %s run %s (%s) in %s; `make experiments` shows the table",
            "logged" if new else "this record is",
            run_id,
            record.name,
            uri,
        )
        return run_id
    except Exception as exc:  # noqa: BLE001 - the table mirrors the record; it never fails the run
        log.warning(
            "warning: MLflow store %s not written (%s: %s); the run's record (dvc.lock, reports/) is complete "
            "without it",
            uri,
            type(exc).__name__,
            _first_line(exc),
        )
        return None


def register_production(p: Params, onnx: Path, onnx_sha256: str, root: Path | None = None) -> str | None:
    """The promoted ONNX as a version of tracking.registered_model, alias `production`. One warning on failure."""
    root = root or Path.cwd()
    uri = tracking_uri(project_root(root))
    try:
        with _quiet_http():
            run_id = mirror(p, root)
            if run_id is None:
                return None
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
