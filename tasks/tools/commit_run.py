"""`python -m tasks.tools.commit_run` (make commit-run, before its `git commit`): exit 1 with one line when this
workspace's run must not become the project's record: a record that is not this workspace's run
(tasks/tools/record.py), then the verdict, the experiment flag and the test hooks (tasks/release/gate.py), then
a file a stage depends on that the commit would not hold (`unstaged_deps`): dvc.lock would name its md5 while the
commit keeps the old bytes, and a clone of it would be stale from its first command. `--message MSG` prints the
commit message: MSG, plus the promotion this commit keeps (tasks/tools/decision.py), who, why and what was set aside.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from tasks.core.dag import DagError, load_stages
from tasks.core.errors import StageError
from tasks.core.io import read_json
from tasks.core.params import PARAMS_FILE, ParamsError, load_params
from tasks.release.gate import commit_refusal
from tasks.tools.decision import commit_trailer
from tasks.tools.record import record_refusal


def _read(path: Path) -> dict[str, Any]:
    try:
        return read_json(path)
    except FileNotFoundError:
        raise StageError(f"{path}: not there; run the pipeline first (make run)") from None


# What `make commit-run` git-adds itself after this check: the record, and the params and DAG it came from.
STAGED_BY_MAKE = ("dvc.yaml", "dvc.lock", "params.yaml", "reports", "data", "models", "baseline")


def unstaged_deps(root: Path = Path()) -> list[str]:
    """The files dvc.yaml's stages depend on (code, pretrained weights' .dvc files; `${}` deps as DVC resolves
    them, tasks/core/dag.py) that `git commit` would not take as they are: changed since the index, deleted, or
    untracked. Another stage's outputs (DVC's cache holds them) and what make commit-run adds itself
    (STAGED_BY_MAKE) are not asked about; a file already staged is what the commit holds."""
    try:
        stages = load_stages(root).values()
    except DagError as exc:
        raise StageError(str(exc)) from None
    made = {out for stage in stages for out in stage.outs}
    deps = sorted({dep for stage in stages for dep in stage.path_deps} - made)
    deps = [dep for dep in deps if Path(dep).parts[0] not in STAGED_BY_MAKE]
    if not deps:
        return []
    proc = subprocess.run(["git", "status", "--porcelain=v1", "-z", "--untracked-files=all", "--", *deps],
                          cwd=root, capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        raise StageError(f"git status failed in {root.resolve()}: {proc.stderr.strip()}")
    entries = [entry for entry in proc.stdout.split("\0") if entry]
    return sorted(entry[3:] for entry in entries if entry[1] != " ")  # XY path: Y, the worktree against the index


def unstaged_refusal(files: list[str]) -> str | None:
    if not files:
        return None
    shown = " ".join(files[:10]) + (f" (and {len(files) - 10} more)" if len(files) > 10 else "")
    return (f"{shown}: changed and not staged, but the stages depend on them and dvc.lock names their new bytes: "
            f"the commit would hold a record of code it does not hold; `git add {shown}` and make commit-run again, "
            "or `git stash` them and make run")  # fmt: skip


def staged_by_make(root: Path = Path()) -> list[str]:
    """What `make commit-run` git-adds after the check: STAGED_BY_MAKE's paths that are there."""
    return [name for name in STAGED_BY_MAKE if (root / name).exists()]


def main() -> int:
    if sys.argv[1:] == ["--staged-paths"]:  # the Makefile's list, from here
        print(" ".join(staged_by_make()))
        return 0
    if sys.argv[1:2] == ["--message"]:  # after `git add`: the message, with the decision this commit keeps
        message = " ".join(sys.argv[2:]) or "pipeline run: dvc.lock and reports"
        try:
            trailer = commit_trailer(load_params(PARAMS_FILE).paths.baseline)
        except ParamsError:
            trailer = ""
        print(f"{message}\n\n{trailer}" if trailer else message)
        return 0
    try:
        paths = load_params(PARAMS_FILE).paths
        refusal = (record_refusal(paths) or commit_refusal(_read(paths.gate), paths.gate, _read(paths.train_run))
                   or unstaged_refusal(unstaged_deps()))  # fmt: skip
    except (ParamsError, StageError) as exc:
        print(f"[commit-run] error: {exc}", file=sys.stderr)
        return 2
    if refusal:
        print(f"[commit-run] refused: {refusal}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
