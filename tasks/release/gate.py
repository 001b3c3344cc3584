"""What make commit-run and make promote refuse: the recorded gate (reports/gate.json) and the model's marks.

    python -m tasks.release.gate commit-run     # exit 1 with one line when this run must not be committed

commit-run keeps a run as the project's record: it refuses a verdict other than pass or no baseline,
a verdict that `dvc exp run` recorded without enforcing it (run `make run` first: the gate then runs
enforced), and a model trained with test hooks. promote (tasks/tools/promote.py) refuses a regression and a
model trained with test hooks; a baseline of another test set is what promote is for.
`ALLOW_REGRESSION=1` (make commit-run ALLOW_REGRESSION=1, make promote ALLOW_REGRESSION=1) accepts a
recorded regression explicitly; nothing accepts test hooks.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tasks.core.errors import StageError
from tasks.core.io import read_json
from tasks.core.params import PARAMS_FILE, ParamsError, load_params

OVERRIDE = "ALLOW_REGRESSION"
ACCEPTED = ("pass", "no baseline")


def allowed_by_override() -> bool:
    return os.environ.get(OVERRIDE) == "1"


def hooks_refusal(test_hooks: str | None, what: str) -> str | None:
    if not test_hooks:
        return None
    return f"{what}: the model was trained with test hooks ({test_hooks}); it is a test's model, never the project's"


def commit_refusal(gate: Mapping[str, Any], gate_path: Path, train_run: Mapping[str, Any]) -> str | None:
    """Why this run must not become the committed run record, or None."""
    verdict = gate.get("verdict")
    if verdict not in ACCEPTED and not allowed_by_override():
        return (f"{gate_path} records verdict '{verdict}' ({gate.get('summary', '')}); fix the model, or commit it "
                f"anyway with `make commit-run {OVERRIDE}=1`")  # fmt: skip
    if gate.get("enforced") is not True:  # False under dvc exp run; absent in a record older than the field
        return (f"{gate_path}: the verdict '{verdict}' was recorded by `dvc exp run`, which does not enforce it; "
                "run `make run` (the gate then runs enforced), then make commit-run")  # fmt: skip
    return hooks_refusal(train_run.get("test_hooks"), "reports/train_run.json")


def promote_refusal(verdict: Mapping[str, Any], verdict_path: Path) -> str | None:
    """Why this run's model must not become the baseline, or None."""
    if verdict.get("verdict") == "regression" and not allowed_by_override():
        return (
            f"{verdict_path} records a regression against the current baseline ({verdict.get('summary', '')}); "
            f"promoting would make the worse model the baseline. To do it anyway: `make promote {OVERRIDE}=1`"
        )
    return None


def _read(path: Path) -> dict[str, Any]:
    try:
        return read_json(path)
    except FileNotFoundError:
        raise StageError(f"{path}: not there; run the pipeline first (make run)") from None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args != ["commit-run"]:
        print("usage: python -m tasks.release.gate commit-run", file=sys.stderr)
        return 2
    try:
        paths = load_params(PARAMS_FILE).paths
        refusal = commit_refusal(_read(paths.gate), paths.gate, _read(paths.train_run))
    except (ParamsError, StageError) as exc:
        print(f"[commit-run] error: {exc}", file=sys.stderr)
        return 2
    if refusal:
        print(f"[commit-run] refused: {refusal}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
