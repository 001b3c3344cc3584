"""scripts/lock_diff.py names what a run did not reproduce: the stage, the file, and whether its inputs changed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from tests.helpers.project import ROOT, commit, make_project

sys.path.insert(0, str(ROOT / "scripts"))
import lock_diff  # noqa: E402


def stage(deps: dict[str, str], outs: dict[str, str], **params: object) -> dict[str, object]:
    return {
        "deps": [{"path": p, "md5": m} for p, m in deps.items()],
        "params": {"params.yaml": params},
        "outs": [{"path": p, "md5": m} for p, m in outs.items()],
    }


def test_an_output_that_changed_with_the_same_inputs_is_named_as_not_reproduced() -> None:
    old = {"train": stage({"shards": "a"}, {"model.pt": "x"}, train={"lr": 0.1}),
           "evaluate": stage({"model.pt": "x"}, {"metrics.json": "m"})}  # fmt: skip
    new = {"train": stage({"shards": "a"}, {"model.pt": "y"}, train={"lr": 0.1}),
           "evaluate": stage({"model.pt": "y"}, {"metrics.json": "m"})}  # fmt: skip
    assert lock_diff.differences(old, new) == [
        "evaluate: dep model.pt changed",
        "train: model.pt md5 x -> y with the same deps and params: not reproduced",
    ]
    changed = {**new, "train": stage({"shards": "a"}, {"model.pt": "y"}, train={"lr": 0.2})}
    assert "train: params train changed" in lock_diff.differences(old, changed)
    assert "train: model.pt md5 x -> y" in lock_diff.differences(old, changed)
    assert lock_diff.differences(old, old) == []


def test_the_command_exits_1_and_names_the_stage(tmp_path: Path) -> None:
    repo = make_project(tmp_path / "repo")
    lock = {"schema": "2.0", "stages": {"train": stage({"shards": "a"}, {"models/model.pt": "x"})}}
    (repo / "dvc.lock").write_text(yaml.safe_dump(lock))
    commit(repo, "a run")
    script = [sys.executable, str(ROOT / "scripts" / "lock_diff.py")]
    same = subprocess.run(script, cwd=repo, capture_output=True, text=True)
    assert same.returncode == 0 and "reproduces HEAD" in same.stdout
    lock["stages"]["train"]["outs"][0]["md5"] = "z"
    (repo / "dvc.lock").write_text(yaml.safe_dump(lock))
    differs = subprocess.run(script, cwd=repo, capture_output=True, text=True)
    assert differs.returncode == 1 and "train: models/model.pt md5 x -> z" in differs.stdout
