"""A pipeline run's record as MLflow sees it, read from its reports (nothing recomputed): its key, params.yaml
flattened (the names `dvc exp show` uses), the test metrics, the export gates and latencies, the verdict, the
per-epoch history, the lineage tags and the reports people look at. tasks/release/tracking.py writes it.

The key is what identifies the model and its scores: the reports of train, evaluate, export and the gate, less
what a re-gate of the same model and scores rewrites (`VOLATILE`). So a no-op rerun, or `dvc repro` enforcing
the verdict a `dvc exp run` only recorded, finds its record logged already and adds no run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from tasks.core.environment import dvc_experiment
from tasks.core.git import changed_files, head_commit
from tasks.core.io import read_json, sha256_file
from tasks.core.nested import flatten
from tasks.core.params import PARAMS_FILE, Params
from tasks.images.image_set import split_sha256
from tasks.release.mlflow_store import KEY_TAG, Record

TRIAL_ENV = "IMAGEPIPE_SWEEP_TRIAL"  # the sweep's trial number, a tag of the trial's run
FLOW_RUN_URL_ENV = "IMAGEPIPE_FLOW_RUN_URL"  # the Prefect flow run's page (flows/shell.py sets it for its stages)

# What a re-gate of the same model and scores rewrites, by report and dotted key: whether the gate was enforced
# (`dvc exp run` records the verdict, `dvc repro` enforces it) and the score cache's keys (the scoring code and
# environment the scores were made with: reused or made again, the scores are the same).
VOLATILE = {
    "gate": ("enforced",),
    "regression": ("scored", "baseline_rescored.scored"),
}


def record_reports(p: Params) -> dict[str, Path]:
    """The reports a record's key is made of, by name (VOLATILE's names), relative to the project."""
    paths = p.paths
    return {"train_run": paths.train_run, "metrics": paths.metrics, "export": paths.export_report,
            "regression": paths.regression_json, "gate": paths.gate}  # fmt: skip


def record_key(reports: Mapping[str, Any]) -> str:
    """sha256 over the record's reports (name -> parsed JSON, None when absent) less their VOLATILE keys: the
    same model and scores, the same key, in any checkout, copy or temporary experiment folder."""
    kept = {name: _without(content, VOLATILE.get(name, ())) for name, content in reports.items()}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def _without(content: Any, dotted: tuple[str, ...]) -> Any:
    """`content` less the dotted keys (a copy: the caller's dicts stay as they are)."""
    if not isinstance(content, Mapping):
        return content
    drop = {key for key in dotted if "." not in key}
    nested: dict[str, list[str]] = {}
    for key in dotted:
        if "." in key:
            head, rest = key.split(".", 1)
            nested.setdefault(head, []).append(rest)
    return {k: _without(v, tuple(nested.get(k, ()))) for k, v in content.items() if k not in drop}


def _read(path: Path) -> Any:
    return read_json(path) if path.is_file() else None


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
    calibration = metrics.get("calibration") or {}  # evaluate's ECE and NLL, with and without the temperature
    for name in ("temperature", "ece", "ece_uncalibrated", "nll", "nll_uncalibrated"):
        if isinstance(calibration.get(name), (int, float)):
            out[f"test_{name}" if name != "temperature" else "temperature"] = float(calibration[name])
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
        tags["data.test_sha256"] = split_sha256(read_json(manifest_path), "test")  # regression.json's test_set_sha256
    tags["data.source"] = str(p.data.source)
    train_env = _read(root / paths.environment_record("train")) or {}
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
    reports = {name: _read(root / path) for name, path in record_reports(p).items()}
    key = record_key(reports)
    gate = reports["gate"] or {}
    metrics = test_metrics(reports["metrics"] or {})
    metrics |= export_metrics(reports["export"] or {}, _read(root / paths.export_timings) or {})
    if "passed" in gate:
        metrics["gate_passed"] = 1.0 if gate["passed"] else 0.0
    verdict = gate.get("headline") or gate.get("verdict", "none")  # "pass, 11 of 12 rules not judged"
    tags = {KEY_TAG: key, "gate.verdict": str(verdict), **lineage_tags(p, root)}
    scored = (reports["regression"] or {}).get("test_set_sha256")
    if scored:  # the set the gate scored, as the verdict names it
        tags["data.test_sha256"] = str(scored)
    history = _read(root / paths.train_history) or []
    artifacts = [root / f for f in (paths.confusion_png, paths.errors_gallery, paths.train_curves, paths.regression_md)]
    name = tags["dvc.experiment"] or f"{tags['source'].replace(' ', '-')}-{key[:8]}"
    record = Record(key, name, flat_params(root), metrics, history, tags, [a for a in artifacts if a.is_file()])
    record.started = _started(root / paths.environment)
    return record


def nightly_record(
    p: Params, root: Path, metrics: dict[str, Any], verdict: str, passed: bool, onnx_sha256: str,
    flow_run: tuple[str, str] | None = None,
) -> Record:  # fmt: skip
    """regression-flow's check of the production model, keyed by the model, its scores and the verdict (so a
    night on which nothing changed adds no run)."""
    key = hashlib.sha256(json.dumps([onnx_sha256, verdict, metrics], sort_keys=True, default=str).encode()).hexdigest()
    tags = {KEY_TAG: key, "gate.verdict": verdict, **lineage_tags(p, root, flow_run), "source": "regression-flow",
            "production.onnx_sha256": onnx_sha256}  # fmt: skip
    if metrics.get("test_set_sha256"):  # the nightly scores the promoted test set, not today's whole split
        tags["data.test_sha256"] = str(metrics["test_set_sha256"])
    values = {**test_metrics(metrics), "gate_passed": 1.0 if passed else 0.0}
    return Record(key, f"nightly-{key[:8]}", flat_params(root), values, [], tags, [])
