"""A class joins, and the team decides to ship (issue 49): no documented command may lead to a state that only
an undocumented one leaves. A 9-class dataset is run and promoted; a tenth class is merged with `make add-data
INTO=`; `make run` fails (the baseline cannot be re-scored on other classes); `make promote` without a reason is
refused naming ACCEPT; `make promote ACCEPT="..."` makes the 10-class model the baseline with the decision beside
it; `make run` then passes against it, and `make commit-run` keeps the decision in its commit message.

Everything is real: a git + DVC copy of the project driven by the Makefile.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.folders import make_imagefolder
from tests.helpers.project import commit, env_with_venv, make_command, make_project, sh

NAME = "colours"
REASON = "a tenth class joined: it's worth the $5 recall check, done by hand"  # quotes and `$` kept as typed


def make(repo: Path, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    proc = sh(make_command(*args), cwd=repo, check=False)
    if ok:
        assert proc.returncode == 0, f"make {' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def read(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.slow  # about 2 min on 2 cores: two tiny runs, two promotions
def test_a_class_joins_and_a_recorded_decision_promotes_it(tmp_path: Path) -> None:
    repo = make_project(tmp_path / "repo", {"train": {"epochs": 3}})
    sh(["git", "config", "user.name", "Ada Lovelace"], cwd=repo)
    sh(["git", "config", "user.email", "ada@example.com"], cwd=repo)
    images = make_imagefolder(tmp_path / "images", classes=10, per_class=20, seed=0)
    tenth = tmp_path / "tenth"
    tenth.mkdir()
    shutil.move(images / "class_9", tenth / "class_9")
    make(repo, "add-data", f"SRC={images}", f"NAME={NAME}")
    make(repo, "run")
    make(repo, "promote")
    assert read(repo / "baseline" / "decision.json")["set_aside"] is None  # a passing gate sets nothing aside
    commit(repo, "nine classes, promoted")

    # The tenth class joins: the gate cannot compare, so make run fails, and says what leads out.
    make(repo, "add-data", f"SRC={tenth}", f"INTO={NAME}")
    commit(repo, "data: the tenth class")
    failed = make(repo, "run", ok=False)
    assert failed.returncode != 0
    assert 'make promote ACCEPT="<why>"' in failed.stderr, failed.stderr[-2000:]
    refused = make(repo, "commit-run", ok=False)  # the failed gate, named, and the way out
    assert refused.returncode != 0 and "the gate failed on this run" in refused.stderr, refused.stderr[-2000:]
    assert 'make promote ACCEPT="<why>"' in refused.stderr
    refused = make(repo, "promote", ok=False)  # no reason, no promotion; baseline/ untouched
    assert refused.returncode != 0 and 'make promote ACCEPT="<why>"' in refused.stderr, refused.stderr[-2000:]
    assert len(read(repo / "baseline" / "model.json")["class_names"]) == 9
    exported = subprocess.run(make_command("promote"), cwd=repo, env={**env_with_venv(), "ACCEPT": "from a shell"},
                              capture_output=True, text=True)  # fmt: skip
    assert exported.returncode != 0, "an ACCEPT left in the environment accepted a failed gate"

    make(repo, "promote", f"ACCEPT={REASON}")
    assert len(read(repo / "baseline" / "model.json")["class_names"]) == 10
    decision = read(repo / "baseline" / "decision.json")
    assert decision["reason"] == REASON and decision["by"] == "Ada Lovelace" and decision["accepted"] is True
    assert decision["set_aside"]["verdict"] == "different test set", decision
    assert "The classes differ" in decision["set_aside"]["summary"]
    assert (repo / "baseline" / "decision.json.dvc").is_file()  # DVC-tracked with the baseline

    make(repo, "commit-run", "MSG=promote the ten-class model")  # straight after: promote ran the gate again
    message = sh(["git", "log", "-1", "--format=%B"], cwd=repo).stdout
    assert message.startswith("promote the ten-class model"), message
    assert f"Accepted: {REASON}" in message and "Set aside: different test set: the baseline was" in message, message
    assert "by Ada Lovelace" in message

    again = make(repo, "run")  # against the 10-class baseline now
    gate = read(repo / "reports" / "gate.json")
    assert gate["verdict"] == "pass", gate
    assert read(repo / "reports" / "regression.json")["baseline_rescored"]["onnx_sha256"] == decision["onnx_sha256"]
    assert "PASS" in again.stdout + again.stderr
