"""`make run`'s second step: every stage whose outputs here came from git, `dvc pull` or the run cache (no line
of this workspace's run ledger vouches for them) is run again, so `make check-reproduced` can judge it.

After `dvc repro`, DVC skips a stage whose outputs are there with the recorded hashes, though this machine
never computed them (a fresh clone's evaluate: git carries its outputs, and train made the same model again).
Each such stage runs with `dvc repro --force --single-item`, in dvc.yaml's order; then one more `dvc repro`
carries a changed output downstream. `dvc repro` itself keeps DVC's behaviour.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tasks.core import provenance
from tasks.core.cli import stage_main
from tasks.core.errors import StageError
from tasks.core.params import Params


def _dvc(*args: str) -> None:
    command = [sys.executable, "-m", "dvc", *args]
    if subprocess.run(command).returncode != 0:
        raise StageError(f"`dvc {' '.join(args)}` failed (its output is above); the run is not complete")


def recompute(root: Path) -> list[str]:
    """Run the stages no run here computed; returns their names."""
    if not (root / "dvc.lock").is_file():
        return []
    missing, _ = provenance.not_recomputed(root)
    for stage in missing:
        print(f"[recompute] {stage}: its outputs came from git, `dvc pull` or the run cache; computing it here")
        _dvc("repro", "--force", "--single-item", stage)
    if missing:
        _dvc("repro")
    return missing


def _main(params: Params) -> None:
    del params  # validated by stage_main; the stages read their own sections
    recompute(Path.cwd())


def main() -> None:
    stage_main("recompute", _main)


if __name__ == "__main__":
    main()
