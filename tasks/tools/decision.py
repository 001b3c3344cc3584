"""A promotion as a recorded act: baseline/decision.json (beside the baseline, DVC-tracked with it), the tags of
its MLflow registry version, and the lines `make commit-run` adds to the commit that keeps it.

make promote writes it every time: who and when, the verdict of the gate that ran against the previous
baseline, and, when that verdict did not pass (a regression, a `different test set`), the reason a person gave
with ACCEPT="<why>" and what was set aside. Times live here and not in any stage output: a decision is a
person's act, not a computation to reproduce.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tasks.core.git import author, git_output
from tasks.core.io import read_json
from tasks.core.paths import BASELINE_DECISION
from tasks.release.gate import ACCEPTED


def utc_now() -> str:
    """When a person acted, as every decision record writes it (UTC, seconds)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def decision_record(verdict: Mapping[str, Any], onnx_sha256: str, reason: str | None, root: Path = Path()) -> dict:
    """baseline/decision.json for promoting the model `onnx_sha256` over the gate's `verdict`."""
    status = verdict.get("verdict")
    set_aside = None
    if status not in ACCEPTED:
        failed = [r for r in verdict.get("rules") or [] if isinstance(r, Mapping) and r.get("passed") is False]
        set_aside = {"verdict": status, "summary": verdict.get("summary", ""), "failed_rules": failed,
                     "baseline_sha256": verdict.get("baseline_sha256")}  # fmt: skip
    return {
        "onnx_sha256": onnx_sha256,
        "gate": status,
        "accepted": set_aside is not None,
        "reason": reason,
        "set_aside": set_aside,
        "by": author(root),
        "at": utc_now(),
    }


def registry_tags(decision: Mapping[str, Any]) -> dict[str, str]:
    """The decision as the MLflow registry version's tags (strings; the full record stays in baseline/)."""
    set_aside = decision.get("set_aside") or {}
    tags = {"decision.gate": str(decision.get("gate")), "decision.by": str(decision.get("by")),
            "decision.at": str(decision.get("at"))}  # fmt: skip
    if decision.get("reason"):
        tags["decision.reason"] = str(decision["reason"])[:5000]
    if set_aside:
        tags["decision.set_aside"] = _set_aside(set_aside)[:5000]
    return tags


def commit_trailer(baseline_dir: Path, root: Path = Path()) -> str:
    """The lines the commit that keeps a new decision gets: empty unless the staged baseline/decision.json.dvc
    differs from HEAD's (this commit holds a new promotion); who and when, and the reason and the verdict set
    aside when there was one."""
    dvc_file = (baseline_dir / f"{BASELINE_DECISION}.dvc").as_posix()
    if git_output(root, "diff", "--cached", "--name-only", "--", dvc_file) != dvc_file:
        return ""
    try:
        decision = read_json(root / baseline_dir / BASELINE_DECISION)
    except (OSError, ValueError):
        return ""
    lines = [f"Promoted: {str(decision.get('onnx_sha256'))[:12]} by {decision.get('by')} at {decision.get('at')} "
             f"(gate: {decision.get('gate')})"]  # fmt: skip
    if decision.get("set_aside"):
        lines.append(f"Accepted: {decision.get('reason')}")
        lines.append(f"Set aside: {_set_aside(decision['set_aside'])}")
    return "\n".join(lines)


def _set_aside(set_aside: Mapping[str, Any]) -> str:
    """`<verdict>: <summary>`, the verdict named once (a `different test set` summary starts with it)."""
    verdict, summary = str(set_aside.get("verdict")), str(set_aside.get("summary", ""))
    return summary if summary.startswith(verdict) else f"{verdict}: {summary}"
