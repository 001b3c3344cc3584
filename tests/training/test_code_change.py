"""A code change to the train stage retrains from step 0, in a real project under `dvc repro train`:
the finished checkpoint of the old code is never resumed nor taken as done (issue: the record only
vouches for work that was done)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tasks.core.io import read_json
from tests.helpers.project import dvc, make_project


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


@pytest.mark.slow  # the default suite's budget (issue 59 item 4): make test-slow runs it
def test_changed_augment_code_retrains_instead_of_resuming_the_finished_run(tmp_path: Path) -> None:
    repo = make_project(tmp_path / "repo", {"train": {"device": "cpu"}})
    dvc("repro", "train", cwd=repo)
    first_model, first_run = md5(repo / "models/model.pt"), read_json(repo / "reports/train_run.json")
    augment = repo / "tasks/training/augment.py"
    source = augment.read_text()
    assert "flips = (u[:, 0] < 0.5) & p.hflip" in source
    augment.write_text(source.replace("flips = (u[:, 0] < 0.5) & p.hflip", "flips = (u[:, 0] < 0.9) & p.hflip"))

    rerun = dvc("repro", "train", cwd=repo)
    log = rerun.stdout + rerun.stderr
    assert "resuming from" not in log, log[-3000:]
    assert "training from step 0: no checkpoint of this run" in log and "code tasks/training/augment.py changed" in log
    again = read_json(repo / "reports/train_run.json")
    assert again["run"] != first_run["run"] and again["code_sha256"] != first_run["code_sha256"]
    assert again["steps"] == first_run["steps"] > 0
    assert md5(repo / "models/model.pt") != first_model  # flips at 0.9 trained other weights
    # Both runs' checkpoints stay (train.keep_checkpoint_runs); restoring the code resumes the finished one.
    augment.write_text(source)
    back = dvc("repro", "train", cwd=repo)
    assert "resuming from" in back.stdout + back.stderr
    assert md5(repo / "models/model.pt") == first_model
