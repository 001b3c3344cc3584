"""A project as a finished run leaves it, for the experiment table's tests: params.yaml and the reports."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.helpers.project import ROOT


def finished_project(root: Path, accuracy: float = 0.9) -> Path:
    """The files a finished run leaves that the table reads: params.yaml and the reports."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy2(ROOT / "params.yaml", root / "params.yaml")
    reports = root / "reports"
    (reports / "environment").mkdir(parents=True, exist_ok=True)
    per_class = {"a": {"f1": 0.8, "precision": 0.8, "recall": 0.8, "support": 5}}
    files = {
        "metrics.json": {"accuracy": accuracy, "macro_f1": 0.8, "loss": 0.3, "per_class": per_class},
        "export.json": {
            "agreement": 1.0,
            "max_abs_diff": 1e-6,
            "onnx_int8": {"agreement": 0.99, "accuracy_drop": 0.01},
        },
        "gate.json": {"verdict": "pass", "passed": True, "enforced": True},
        "regression.json": {"verdict": "pass"},
        "train_run.json": {"run": "r1"},
        "train_history.json": [
            {"epoch": 1, "val_accuracy": 0.5, "lr": 0.1},
            {"epoch": 2, "val_accuracy": 0.7, "lr": 0.0},
        ],
        "export_timings.json": {"latency_ms_median": {"batch_1": {"onnx_fp32": 5.0, "onnx_int8": 1.5}}},
        "environment/train.json": {
            "precision": "bf16",
            "cpu": {"torch_capability": "AVX512"},
            "libraries": {"torch": "2.14.1"},
        },
    }
    for name, content in files.items():
        (reports / name).write_text(json.dumps(content))
    (reports / "regression.md").write_text("# Regression check\n")
    return root
