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
from pathlib import Path
from typing import Any

import yaml

from tasks.core.environment import dvc_experiment
from tasks.core.git import changed_files, head_commit
from tasks.core.io import read_json, sha256_file, write_json
from tasks.core.nested import flatten
from tasks.core.params import PARAMS_FILE, Params
from tasks.release.mlflow_store import KEY_TAG, Record, client, log_record, quiet_http, sqlite_file

log = logging.getLogger(__name__)

DB_FILE = "mlflow.db"
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


def record_key(root: Path, files: list[Path]) -> str:
    """sha256 over the record's outputs (paths relative to the project): the same outputs, the same key, in any
    checkout, copy or temporary experiment folder."""
    digest = hashlib.sha256()
    for name in files:
        path = root / name
        digest.update(f"{name.as_posix()}\0{sha256_file(path) if path.is_file() else '-'}\n".encode())
    return digest.hexdigest()


def _metric_name(text: str) -> str:
    return re.sub(r"[^0-9A-Za-z_\-. /]", "_", text)


def git_tags(root: Path, reports: Path) -> dict[str, str]:
    """The commit and whether code or params differ from it (what DVC writes after a run does not count)."""
    commit = head_commit(root)
    if not commit:
        return {"git.commit": "none"}
    changed = [name for name in changed_files(root) if name != "dvc.lock"]
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


def flat_params(root: Path) -> dict[str, str]:
    """params.yaml flattened, named as `dvc exp show` names them (train.lr, train.augment.hflip, ...)."""
    raw = yaml.safe_load((root / PARAMS_FILE).read_text()) or {}
    return {k: json.dumps(v) if isinstance(v, (list, dict)) else "" if v is None else str(v)
            for k, v in flatten(raw).items()}  # fmt: skip


def test_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    out = {f"test_{name}": float(metrics[name]) for name in ("accuracy", "macro_f1", "macro_precision", "macro_recall",
           "loss") if isinstance(metrics.get(name), (int, float))}  # fmt: skip
    for cls, row in (metrics.get("per_class") or {}).items():
        if isinstance(row, dict) and isinstance(row.get("f1"), (int, float)):
            out[_metric_name(f"f1.{cls}")] = float(row["f1"])
    return out


def export_metrics(export: dict[str, Any], timings: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
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
    return out


def lineage_tags(p: Params, root: Path, flow_run: tuple[str, str] | None = None) -> dict[str, str]:
    """Where a run came from: git, DVC experiment, data, the environment record, the Prefect flow run."""
    paths = p.paths
    tags = git_tags(root, paths.reports)
    experiment = dvc_experiment()
    tags["dvc.experiment"] = experiment or ""
    prefect = flow_run[0] if flow_run else os.environ.get("PREFECT__FLOW_RUN_ID")
    sweep = os.environ.get(TRIAL_ENV)
    tags["source"] = "make sweep" if sweep else "dvc exp run" if experiment else "prefect" if prefect else "dvc repro"
    tags["mlflow.source.name"], tags["mlflow.source.type"] = tags["source"], "LOCAL"  # the UI's Source column
    manifest_path = root / paths.shards / "manifest.json"
    if manifest_path.is_file():
        tags["data.manifest_sha256"] = sha256_file(manifest_path)
        tags["data.test_sha256"] = test_set_sha256(read_json(manifest_path))
    tags["data.source"] = str(p.data.source)
    train_env = _read(root / paths.environment / "train.json") or {}
    cpu = train_env.get("cpu") or {}
    tags["env.precision"] = str(train_env.get("precision", ""))
    tags["env.cpu"] = str(cpu.get("torch_capability", ""))
    tags["env.cpu_flags"] = " ".join(cpu.get("flags", []))
    tags["env.torch"] = str((train_env.get("libraries") or {}).get("torch", ""))
    tags["env.device"] = str(train_env.get("device", ""))
    if prefect:
        tags["prefect.flow_run_id"] = prefect
        api = os.environ.get("PREFECT_API_URL", "").removesuffix("/api")
        url = (flow_run[1] if flow_run else os.environ.get(FLOW_RUN_URL_ENV)) or (
            f"{api.rstrip('/')}/runs/flow-run/{prefect}" if api else ""
        )
        if url:
            tags["prefect.flow_run_url"] = url
    if sweep:
        tags["sweep.trial"] = sweep
        tags["sweep.state"] = "complete"
    return tags


def _started(records: Path) -> int | None:
    """When this run began: the environment stage writes its records first on every `dvc repro`, so the oldest of
    them dates the run (the MLflow table's Created and Duration columns)."""
    stamps = [f.stat().st_mtime for f in records.glob("*.json")] if records.is_dir() else []
    return int(min(stamps) * 1000) if stamps else None


def gather(p: Params, root: Path) -> Record:
    """The record of the run in `root`, read from its reports (nothing is recomputed)."""
    paths = p.paths
    key = record_key(root, [f for f in (paths.metrics, paths.export_report, paths.regression_json, paths.gate,
                                         paths.train_run)])  # fmt: skip
    gate = _read(root / paths.gate) or {}
    metrics = test_metrics(_read(root / paths.metrics) or {})
    metrics |= export_metrics(_read(root / paths.export_report) or {}, _read(root / paths.export_timings) or {})
    if "passed" in gate:
        metrics["gate_passed"] = 1.0 if gate["passed"] else 0.0
    tags = {KEY_TAG: key, "gate.verdict": str(gate.get("verdict", "none")), **lineage_tags(p, root)}
    history = _read(root / paths.train_history) or []
    artifacts = [root / f for f in (paths.confusion_png, paths.errors_gallery, paths.train_curves, paths.regression_md)]
    name = tags["dvc.experiment"] or f"{tags['source'].replace(' ', '-')}-{key[:8]}"
    record = Record(key, name, flat_params(root), metrics, history, tags, [a for a in artifacts if a.is_file()])
    record.started = _started(root / paths.environment)
    return record


def nightly(
    p: Params, root: Path, metrics: dict[str, Any], verdict: str, passed: bool, onnx_sha256: str,
    flow_run: tuple[str, str] | None = None,
) -> str | None:  # fmt: skip
    """regression-flow's check of the production model as one run (keyed by the model, its scores and the verdict,
    so a night on which nothing changed adds none). One warning line when the store fails."""
    if _disabled(p):
        return None
    try:
        scored = json.dumps([onnx_sha256, verdict, metrics], sort_keys=True, default=str)
        key = hashlib.sha256(scored.encode()).hexdigest()
        tags = {KEY_TAG: key, "gate.verdict": verdict, **lineage_tags(p, root, flow_run), "source": "regression-flow",
                "production.onnx_sha256": onnx_sha256}  # fmt: skip
        values = {**test_metrics(metrics), "gate_passed": 1.0 if passed else 0.0}
        record = Record(key, f"nightly-{key[:8]}", flat_params(root), values, [], tags, [])
        return _log(p, root, record)
    except Exception as exc:  # noqa: BLE001 - the table mirrors the record; it never fails the run
        _warn(tracking_uri(project_root(root)), exc)
        return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


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
    with quiet_http():
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


def register_production(p: Params, onnx: Path, onnx_sha256: str, root: Path | None = None) -> str | None:
    """The promoted ONNX as a version of tracking.registered_model, alias `production`. One warning on failure."""
    root = root or Path.cwd()
    uri = tracking_uri(project_root(root))
    try:
        with quiet_http():
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
