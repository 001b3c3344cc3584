"""Prefect artifacts from the stages' reports: metrics table, export parity, regression verdict, run manifest.

report file -> a table or Markdown artifact under a fixed key, so the UI's Artifacts page keeps each one's history.
`flatten` and `verdict_markdown` are pure; `publish_*` need a running flow or task.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from tasks.core import nested
from tasks.core.paths import Paths
from tasks.release.verdict import Verdict
from tasks.release.verdict_table import format_table


def stage_reports(paths: Paths) -> dict[str, Path]:
    """The report each stage's artifact is made from (tests/flows/test_flow.py checks that dvc.yaml declares
    each one as that stage's output)."""
    return {"evaluate": paths.metrics, "export": paths.export_report, "check_regression": paths.regression_md}


def picture_paths(paths: Paths) -> list[Path]:
    """The PNGs a run writes, which the comparison artifact links to by their paths."""
    return [paths.train_batch_png, paths.val_batch_png, paths.train_curves, paths.confusion_png, paths.per_class_png,
            paths.errors_gallery]  # fmt: skip


KEYS = {
    "evaluate": "train-flow-metrics",
    "export": "train-flow-export-parity",
    "check_regression": "train-flow-regression-verdict",
    "manifest": "train-flow-run-manifest",
    "why": "train-flow-why",
    "comparison": "train-flow-comparison",
    "nightly": "regression-flow-verdict",
}


def flatten(obj: Any) -> list[dict[str, Any]]:
    """Nested JSON as table rows of dotted keys (`per_class.cat.recall`), the names regression rules use."""
    return [{"key": key, "value": json.dumps(value) if isinstance(value, list | tuple) else value}
            for key, value in sorted(nested.flatten(obj).items())]  # fmt: skip


def verdict_markdown(verdict: Verdict, *, title: str, notes: list[str] | None = None) -> str:
    status = verdict.status.upper()
    lines = [f"# {title}: {status}", "", *[f"- {note}" for note in notes or []], ""]
    return "\n".join([*lines, format_table(verdict, markdown=True), ""])


def publish_report(stage: str, report_path: Path) -> None:
    """The artifact for one stage's report: metrics table, parity table, or the verdict's own Markdown."""
    if stage == "check_regression":
        description = "the exported model scored on the test split vs the promoted baseline"
        create_markdown_artifact(report_path.read_text(), key=KEYS[stage], description=description)
        return
    what = {"evaluate": "test-set metrics", "export": "export parity with PyTorch, per format"}[stage]
    create_table_artifact(
        flatten(json.loads(report_path.read_text())), key=KEYS[stage], description=f"{what} ({report_path})"
    )


def publish_manifest(manifest: Mapping[str, Any], manifest_path: Path) -> None:
    create_table_artifact(
        flatten(manifest), key=KEYS["manifest"], description=f"what made this run's outputs (also in {manifest_path})"
    )


def publish_why(markdown: str) -> None:
    create_markdown_artifact(markdown, key=KEYS["why"], description="why each stage ran: DVC's status before it")


def publish_comparison(markdown: str) -> None:
    create_markdown_artifact(
        markdown, key=KEYS["comparison"], description="this run vs the previous completed run and the baseline"
    )


def publish_nightly(verdict: Verdict, notes: list[str]) -> None:
    create_markdown_artifact(
        verdict_markdown(verdict, title="Production model vs baseline", notes=notes),
        key=KEYS["nightly"],
        description="regression-flow: the production model scored on the fixed test set",
    )


def publish_no_baseline(message: str) -> None:
    create_markdown_artifact(
        f"# Production model vs baseline: NO BASELINE\n\n{message}\n",
        key=KEYS["nightly"],
        description="regression-flow: nothing promoted yet, nothing checked",
    )


def publish_integrity_failure(error: Exception) -> None:
    create_markdown_artifact(
        f"## Production model vs baseline: INTEGRITY FAILURE\n\n```\n{error}\n```\n",
        key=KEYS["nightly"],
        description="regression-flow: the model file is not the one whose hash was recorded",
    )
