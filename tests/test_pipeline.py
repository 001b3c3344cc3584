"""The whole DAG through real DVC in a real git repo, on tiny params: reproducible, incremental, gated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.helpers.folders import make_imagefolder
from tests.helpers.project import dvc, make_project, sh


def lock_md5s(repo: Path) -> dict[str, str]:
    """md5 of every output recorded in dvc.lock, by path."""
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    return {out["path"]: out["md5"] for stage in lock["stages"].values() for out in stage.get("outs", [])}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = make_project(tmp_path_factory.mktemp("pipeline") / "repo")
    dvc("repro", cwd=repo)
    return repo


def test_repro_produces_every_output(repo: Path) -> None:
    metrics = json.loads(dvc("metrics", "show", "--json", cwd=repo).stdout)
    accuracy = metrics[""]["data"]["reports/metrics.json"]["data"]["accuracy"]
    pairs = json.loads((repo / "reports/confusion.json").read_text())  # one {actual, predicted} row per test image
    assert accuracy == pytest.approx(sum(r["actual"] == r["predicted"] for r in pairs) / len(pairs), abs=1e-6)
    for path in ("models/model.pt", "models/model.onnx", "reports/confusion.png", "reports/train_curves.png"):
        assert (repo / path).stat().st_size > 0
    verdict = json.loads((repo / "reports/regression.json").read_text())
    assert verdict["passed"] and not verdict["has_baseline"]
    assert len(lock_md5s(repo)) >= 9


def test_second_repro_changes_nothing(repo: Path) -> None:
    before = (repo / "dvc.lock").read_text()
    out = dvc("repro", cwd=repo).stdout
    assert "Data and pipelines are up to date" in out
    assert (repo / "dvc.lock").read_text() == before
    assert "Data and pipelines are up to date" in dvc("status", cwd=repo).stdout


def test_from_scratch_twice_gives_identical_outputs(repo: Path, tmp_path: Path) -> None:
    other = make_project(tmp_path / "again")
    dvc("repro", cwd=other)
    assert lock_md5s(other) == lock_md5s(repo)


def test_worse_than_baseline_fails_the_pipeline(repo: Path) -> None:
    baseline = repo / "baseline" / "metrics.json"
    baseline.write_text(json.dumps({"accuracy": 1.0, "macro_f1": 1.0}))
    try:
        proc = dvc("repro", cwd=repo, check=False)
        assert proc.returncode != 0
        assert "REGRESSION: accuracy, macro_f1" in proc.stderr + proc.stdout
        verdict = json.loads((repo / "reports/regression.json").read_text())
        assert not verdict["passed"] and verdict["rules"][0]["baseline"] == 1.0
    finally:
        baseline.unlink()
    dvc("repro", cwd=repo)


def test_users_own_folder_with_other_classes(repo: Path, tmp_path: Path) -> None:
    source = make_imagefolder(tmp_path / "my images", classes=4, per_class=15)
    sh(["git", "add", "-A"], cwd=repo)
    sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "tiny run"], cwd=repo)
    dvc("exp", "run", "-S", f"data.source={source}", cwd=repo)
    metrics = json.loads((repo / "reports/metrics.json").read_text())
    assert sorted(metrics["per_class"]) == ["class_0", "class_1", "class_2", "class_3"]
    assert sorted(p.name for p in (repo / "data/generated").iterdir()) == ["SKIPPED.txt"]
