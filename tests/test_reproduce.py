"""`make reproduce` refuses what it cannot try, in one line, and leaves the workspace as it was.
(Reproducing a real run, and an interrupted one: tests/test_pipeline.py.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.project import ROOT, commit, dvc, env_with_venv, make_project, sh

pytestmark = pytest.mark.fast


def reproduce(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "scripts/reproduce.py"), *args], cwd=repo, capture_output=True,
                          text=True, env=env_with_venv())  # fmt: skip


def errors(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project whose raw data is DVC-tracked (an input) and whose commit records a run (a dvc.lock)."""
    repo = make_project(tmp_path / "repo")
    raw = repo / "data" / "raw" / "pets" / "cat"
    raw.mkdir(parents=True)
    (raw / "a.png").write_bytes(b"not really a png")
    dvc("add", "data/raw/pets", cwd=repo)
    commit(repo, "data")
    (repo / "dvc.lock").write_text("schema: '2.0'\nstages: {}\n")
    commit(repo, "a run record")
    return repo


def untouched(repo: Path, status: str) -> None:
    assert sh(["git", "status", "--porcelain"], cwd=repo).stdout == status
    assert len(sh(["git", "worktree", "list"], cwd=repo).stdout.splitlines()) == 1


def test_a_rev_that_is_not_a_commit_or_has_no_record(project: Path) -> None:
    status = sh(["git", "status", "--porcelain"], cwd=project).stdout
    bad = reproduce(project, "no-such-rev")
    assert bad.returncode == 2 and errors(bad) == [
        "error: make reproduce: REV=no-such-rev is not a commit of this repository (git rev-parse found none); "
        "give a commit, branch or tag: make reproduce REV=HEAD~1"
    ], bad.stderr
    unrecorded = reproduce(project, "HEAD~1")
    assert unrecorded.returncode == 2, unrecorded.stderr
    assert errors(unrecorded)[0].endswith("has no dvc.lock: no run was recorded there to reproduce")
    untouched(project, status)


def test_inputs_in_no_cache_and_no_remote_are_named_with_how_to_push_them(project: Path, tmp_path: Path) -> None:
    shutil.rmtree(project / ".dvc" / "cache")  # a clone that never had the data
    status = sh(["git", "status", "--porcelain"], cwd=project).stdout
    alone = reproduce(project)
    assert alone.returncode == 2, alone.stdout + alone.stderr
    assert errors(alone) == [
        "error: make reproduce: inputs not in this workspace's DVC cache and no DVC remote to pull them from: "
        "data/raw/pets; on the machine that has them, `dvc remote add -d storage <url>`, commit .dvc/config and "
        "`dvc push data/raw/pets.dvc`"
    ], alone.stderr
    untouched(project, status)
    storage = tmp_path / "empty-storage"
    storage.mkdir()
    dvc("remote", "add", "-d", "storage", str(storage), cwd=project)
    commit(project, "a DVC remote that does not have the data")
    empty = reproduce(project)
    assert empty.returncode == 2, empty.stdout + empty.stderr
    assert errors(empty) == [
        f"error: make reproduce: inputs missing from the DVC remote 'storage' ({storage}): data/raw/pets; push them "
        "from the machine that has them: `dvc push data/raw/pets.dvc`"
    ], empty.stderr
    untouched(project, "")
    assert "reproduce: took " in empty.stdout
