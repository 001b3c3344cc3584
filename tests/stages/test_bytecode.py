"""Python's bytecode beside the code a stage depends on is no part of it: a stage run where Python writes
__pycache__ (PYTHONDONTWRITEBYTECODE unset, as on most machines) leaves every stage up to date, and git sees
no new file (the test projects ignore bytecode as the project does)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.project import env_with_venv, make_project


@pytest.mark.slow  # the default suite's budget (issue 59 item 4): make test-slow runs it
def test_the_bytecode_a_stage_writes_beside_its_code_changes_none_of_its_deps(tmp_path: Path) -> None:
    repo = make_project(tmp_path / "repo")
    env = {k: v for k, v in env_with_venv().items() if k != "PYTHONDONTWRITEBYTECODE"}

    def dvc(*args: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    dvc("repro", "train")  # each stage after the first loads (and compiles) modules of tasks/ that the others do not
    assert list((repo / "tasks").rglob("*.pyc")), "the stage wrote no bytecode: the test tests nothing"
    status = json.loads(dvc("status", "--json", "train") or "{}")
    assert {stage: why for stage, why in status.items() if why != ["always changed"]} == {}
    untracked = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "tasks"], cwd=repo,
                               capture_output=True, text=True).stdout  # fmt: skip
    assert ".pyc" not in untracked  # make commit-run asks git about the code deps: bytecode is not one
