"""`python -m tasks.tools.commit_run` (make commit-run, before its `git commit`): exit 1 with one line when this
workspace's run must not become the project's record: a record that is not this workspace's run
(tasks/tools/record.py), then the verdict, the experiment flag and the test hooks (tasks/release/gate.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tasks.core.errors import StageError
from tasks.core.io import read_json
from tasks.core.params import PARAMS_FILE, ParamsError, load_params
from tasks.release.gate import commit_refusal
from tasks.tools.record import record_refusal


def _read(path: Path) -> dict[str, Any]:
    try:
        return read_json(path)
    except FileNotFoundError:
        raise StageError(f"{path}: not there; run the pipeline first (make run)") from None


def main() -> int:
    try:
        paths = load_params(PARAMS_FILE).paths
        refusal = record_refusal(paths) or commit_refusal(_read(paths.gate), paths.gate, _read(paths.train_run))
    except (ParamsError, StageError) as exc:
        print(f"[commit-run] error: {exc}", file=sys.stderr)
        return 2
    if refusal:
        print(f"[commit-run] refused: {refusal}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
