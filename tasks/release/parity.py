"""Export gates: a candidate's logits vs a reference (top-1 agreement, max/mean |difference|), INT8 vs fp32.

Pure numpy; every figure rounded so reports built from it are byte-stable. A failed `Check` names
itself and the params.yaml key that set its limit.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tasks.core.errors import StageError
from tasks.core.params import ExportParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Check:
    """One gate: `name` (e.g. onnx.agreement) must be >= or <= the `param` limit."""

    name: str
    value: float
    op: str  # ">=" or "<="
    limit: float
    param: str

    @property
    def passed(self) -> bool:
        return self.value >= self.limit if self.op == ">=" else self.value <= self.limit

    @property
    def metric(self) -> str:  # the name a regression verdict lists it under
        return self.name

    def describe(self) -> str:
        outcome = "ok" if self.passed else "FAIL"
        return f"{self.name} {self.value:.6g} (must be {self.op} export.{self.param} {self.limit:g}): {outcome}"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def parity(reference: np.ndarray, candidate: np.ndarray) -> dict[str, float]:
    """Top-1 agreement and max/mean |logit difference|, rounded so the JSON is byte-stable."""
    diff = np.abs(reference.astype(np.float64) - candidate.astype(np.float64))
    return {
        "agreement": round(float((reference.argmax(1) == candidate.argmax(1)).mean()), 6),
        "max_abs_diff": float(f"{diff.max():.3e}"),
        "mean_abs_diff": float(f"{diff.mean():.3e}"),
    }


def parity_checks(name: str, report: dict[str, float], params: ExportParams) -> list[Check]:
    return [
        Check(f"{name}.agreement", report["agreement"], ">=", params.min_agreement, "min_agreement"),
        Check(f"{name}.max_abs_diff", report["max_abs_diff"], "<=", params.max_abs_diff, "max_abs_diff"),
    ]


def int8_report(fp32: np.ndarray, int8: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    fp32_acc, int8_acc = float((fp32.argmax(1) == labels).mean()), float((int8.argmax(1) == labels).mean())
    return {
        "fp32_accuracy": round(fp32_acc, 6),
        "accuracy": round(int8_acc, 6),
        "accuracy_drop": round(fp32_acc - int8_acc, 6),
        "agreement": round(float((fp32.argmax(1) == int8.argmax(1)).mean()), 6),
    }


def int8_checks(report: dict[str, float], params: ExportParams) -> list[Check]:
    return [
        Check("onnx_int8.accuracy_drop", report["accuracy_drop"], "<=", params.int8.max_accuracy_drop,
              "int8.max_accuracy_drop"),
        Check("onnx_int8.agreement", report["agreement"], ">=", params.int8.min_agreement, "int8.min_agreement"),
    ]  # fmt: skip


def enforce(checks: list[Check]) -> None:
    """Log every check; raise StageError naming each failed one."""
    for check in checks:
        log.info("  %s", check.describe())
    failed = [check.describe() for check in checks if not check.passed]
    if failed:
        raise StageError("export gate failed, nothing was written:\n  " + "\n  ".join(failed))
