"""`make reproduce` refuses what it cannot try, in one line, and leaves the workspace as it was; SIGTERM stops
the stages it started. (Reproducing a real run, and one interrupted with Ctrl-C: tests/test_pipeline.py.)"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
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


STAGE = """import os, sys, time
marker = sys.argv[1]
with open(marker, "a") as out:
    out.write(f"{os.getpid()}\\n")
    out.flush()
    for _ in range(600):  # a stage at work: a line every 0.1 s, for a minute at most
        time.sleep(0.1)
        out.write("working\\n")
        out.flush()
"""


def test_sigterm_stops_the_stages_dvc_started_before_the_worktree_goes(tmp_path: Path) -> None:
    """SIGTERM to `make reproduce` (a CI timeout, `kill <pid>`) stops dvc and the stage it runs, then removes the
    worktree: no stage writes on into a removed folder. The stage here stands in for train: it writes a line to a
    file outside the worktree every 0.1 s."""
    repo = tmp_path / "repo"
    repo.mkdir()
    marker, script = tmp_path / "marker.txt", tmp_path / "stage.py"
    script.write_text(STAGE)
    sh(["git", "init", "-q"], cwd=repo)
    dvc("init", "-q", cwd=repo)
    dvc("config", "core.analytics", "false", cwd=repo)
    (repo / "dvc.yaml").write_text(f"stages:\n  work:\n    cmd: {sys.executable} {script} {marker}\n")
    (repo / "dvc.lock").write_text("schema: '2.0'\nstages: {}\n")
    (repo / "params.yaml").write_text("{}\n")
    commit(repo, "a stage that works for a minute")
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"  # files: a stage left running would hold a pipe open
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, str(ROOT / "scripts/reproduce.py"), "HEAD"], cwd=repo,
                                stdout=stdout, stderr=stderr, env=env_with_venv())  # fmt: skip
    stage = None
    try:
        deadline = time.monotonic() + 60
        while not (marker.is_file() and marker.read_text().count("\n") > 2):
            assert time.monotonic() < deadline and proc.poll() is None, "the stage never started"
            time.sleep(0.1)
        stage = int(marker.read_text().split()[0])
        proc.send_signal(signal.SIGTERM)  # to the script alone, not its group
        assert proc.wait(timeout=60) == 130, out.read_text() + err.read_text()
        assert not psutil.pid_exists(stage) or psutil.Process(stage).status() == psutil.STATUS_ZOMBIE, (
            "the stage outlived make reproduce"
        )
        written = marker.stat().st_size
        time.sleep(0.5)
        assert marker.stat().st_size == written, "the stage still writes"
        assert "interrupted; the scratch worktree is removed" in err.read_text()
        scratch = Path(out.read_text().splitlines()[0].rsplit(", ", 1)[-1].strip())
        assert not scratch.exists(), scratch
        assert len(sh(["git", "worktree", "list"], cwd=repo).stdout.splitlines()) == 1
    finally:
        proc.kill()
        if stage is not None:
            with contextlib.suppress(psutil.Error):
                psutil.Process(stage).kill()
