"""make push / make pull: DVC's push and pull with one clear line for each way they fail, and nothing lost.
Real DVC, real git, a local folder as the remote."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers.project import ROOT, commit, dvc, make_project, sh

SYNC = [sys.executable, str(ROOT / "scripts" / "dvc_sync.py")]


def sync(repo: Path, command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SYNC, command], cwd=repo, capture_output=True, text=True, timeout=120)


def test_push_and_pull_failures_are_one_line_each(tmp_path: Path) -> None:
    repo = make_project(tmp_path / "repo")
    (repo / "data").mkdir()
    (repo / "data" / "a.txt").write_text("the user's data")
    dvc("add", "data/a.txt", cwd=repo)

    none = sync(repo, "push")
    assert none.returncode == 2 and "no DVC remote configured; add one: `dvc remote add -d storage" in none.stderr

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    dvc("remote", "add", "-d", "storage", str(blocker / "store"), cwd=repo)
    unreachable = sync(repo, "push")
    assert unreachable.returncode == 1
    last = unreachable.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: dvc push: remote 'storage' ({blocker / 'store'}) cannot be reached or written")
    assert "Not a directory" in last and "nothing local was changed" in last
    assert (repo / "data" / "a.txt").read_text() == "the user's data"

    store = tmp_path / "store"
    dvc("remote", "modify", "storage", "url", str(store), cwd=repo)
    assert sync(repo, "push").returncode == 0
    commit(repo, "data")
    shutil.rmtree(store / "files")  # the object is gone from the remote
    clone = tmp_path / "clone"
    sh(["git", "clone", "-q", str(repo), str(clone)], cwd=tmp_path)
    missing = sync(clone, "pull")
    assert missing.returncode == 1
    last = missing.stderr.strip().splitlines()[-1]
    assert f"dvc pull: remote 'storage' ({store}) does not have the files of " in last
    assert "data/a.txt" in last.split("does not have the files of ")[1]
    assert "push them from the machine that made them" in last
