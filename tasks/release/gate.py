"""What make commit-run and make promote refuse: the recorded gate (reports/gate.json) and the model's marks.
The commands themselves are tasks/tools/commit_run.py and tasks/tools/promote.py.

commit-run keeps a run as the project's record: it refuses a verdict other than pass or no baseline, a
verdict that `dvc exp run` recorded without enforcing it (run `make run` first: the gate then runs
enforced), and a model trained with test hooks. promote refuses the same failed or incomparable verdicts
(a regression, a `different test set`) unless a person accepts it: `make promote ACCEPT="<why>"` records the
reason, the verdict set aside, who and when (baseline/decision.json, the registry version, the commit), and
the gate then holds against the new baseline. Nothing accepts test hooks.

Both first refuse a record that is not this workspace's (tasks/tools/record.py): a stage that DVC's own status
says is not up to date (a partial run such as `dvc repro export` after a params change), a verdict scored
on another ONNX file or against another baseline than the one here now (a teammate's baseline pulled since),
and a failed export gate (INT8 against fp32), whatever the verdict says. Nothing overrides these: the fix is
to run the pipeline (`dvc repro`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

ACCEPTED = ("pass", "no baseline")
ACCEPT_COMMAND = 'make promote ACCEPT="<why>"'  # the one way past a failed or incomparable gate, recorded


def hooks_refusal(test_hooks: str | None, what: str) -> str | None:
    if not test_hooks:
        return None
    return f"{what}: the model was trained with test hooks ({test_hooks}); it is a test's model, never the project's"


def commit_refusal(gate: Mapping[str, Any], gate_path: Path, train_run: Mapping[str, Any]) -> str | None:
    """Why this run must not become the committed run record, or None."""
    verdict = gate.get("verdict")
    if verdict not in ACCEPTED:
        return (f"{gate_path} records verdict '{verdict}' ({gate.get('summary', '')}); fix the model, or ship it "
                f"anyway as the new baseline, recorded: `{ACCEPT_COMMAND}`, then make commit-run")  # fmt: skip
    if gate.get("enforced") is not True:  # False under dvc exp run; absent in a record older than the field
        return (f"{gate_path}: the verdict '{verdict}' was recorded by `dvc exp run`, which does not enforce it; "
                "run `make run` (the gate then runs enforced), then make commit-run")  # fmt: skip
    return hooks_refusal(train_run.get("test_hooks"), "reports/train_run.json")


def failed_export_gates(verdict: Mapping[str, Any]) -> list[str]:
    """The export gates (INT8 vs fp32) the verdict holds that fail, judged again from value, op and limit."""
    failed = []
    for gate in verdict.get("export_gates") or []:
        value, op, limit = gate.get("value"), gate.get("op"), gate.get("limit")
        holds = isinstance(value, int | float) and isinstance(limit, int | float) and (
            (op == ">=" and value >= limit) or (op == "<=" and value <= limit))  # fmt: skip
        if not holds or gate.get("passed") is not True:
            failed.append(f"{gate.get('name')} {value} (must be {op} {limit}, {gate.get('param')})")
    return failed


def promote_refusal(verdict: Mapping[str, Any], verdict_path: Path, *, accepted: bool) -> str | None:
    """Why this run's model must not become the baseline without a person's recorded reason, or None."""
    if verdict.get("verdict") in ACCEPTED or accepted:
        return None
    return (f"{verdict_path} records verdict '{verdict.get('verdict')}' against the current baseline "
            f"({verdict.get('summary', '')}); to make this model the baseline anyway, say why: `{ACCEPT_COMMAND}` "
            "(the reason, the verdict set aside, who and when are recorded beside the baseline)")  # fmt: skip
