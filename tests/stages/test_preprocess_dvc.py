"""The preprocess stage under real DVC: data.test_source unset (the default) and set, tracked as a dep."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.helpers.folders import make_imagefolder
from tests.helpers.project import TINY, deep_update, dvc, make_project, write_params


def test_fixed_test_folder_through_dvc(tmp_path: Path) -> None:
    repo = make_project(tmp_path / "repo")
    dvc("repro", "preprocess", cwd=repo)
    manifest = json.loads((repo / "data/shards/manifest.json").read_text())
    assert manifest["split_rule"]["test"] == "hash range" and manifest["splits"]["test"]["count"] > 0

    # A fixed test folder whose classes are two of the generated ones.
    test = make_imagefolder(tmp_path / "fixed test", classes=2, per_class=5, seed=8)
    (test / "class_0").rename(test / "circle")
    (test / "class_1").rename(test / "square")
    write_params(repo, deep_update(TINY, {"data": {"test_source": str(test)}}))
    assert "preprocess" in dvc("status", "preprocess", cwd=repo).stdout
    dvc("repro", "preprocess", cwd=repo)
    manifest = json.loads((repo / "data/shards/manifest.json").read_text())
    assert manifest["split_rule"]["test"] == "data.test_source"
    assert manifest["splits"]["test"]["count"] == 10 == manifest["test_set"]["count"]
    assert {f["root"] for f in manifest["files"] if f["split"] == "test"} == {"test_source"}
    assert "up to date" in dvc("status", "preprocess", cwd=repo).stdout

    # DVC tracks the folder: one more test image makes the stage stale.
    shutil.copy(test / "circle" / "000.jpg", test / "circle" / "new.jpg")
    assert "modified" in dvc("status", "preprocess", cwd=repo).stdout
