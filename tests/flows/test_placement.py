"""Placement's checks before anything is sent (flows/placement.py), on real git repositories; the whole
round trip across two checkouts is tests/flows/test_placement_e2e.py (slow)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.dag import load_stages
from flows.placement import (
    PlacementError,
    _check_inputs,
    _commit_on_remote,
    changed_files,
    check_placement,
    dvc_files_in_deps,
    placed_stage,
    written_by_runs,
)
from tests.helpers.project import commit, dvc, make_project, sh


@pytest.fixture
def pushed(tmp_path: Path) -> Path:
    """A committed project whose commit is on its git remote."""
    sh(["git", "init", "-q", "--bare", str(tmp_path / "remote.git")], cwd=tmp_path)
    repo = make_project(tmp_path / "repo")
    commit(repo, "the project")
    sh(["git", "remote", "add", "origin", str(tmp_path / "remote.git")], cwd=repo)
    sh(["git", "push", "-q", "origin", "HEAD:main"], cwd=repo)
    return repo


def test_a_placed_stage_needs_a_dvc_remote(pushed: Path) -> None:
    from prefect.logging import disable_run_logger

    with disable_run_logger(), pytest.raises(PlacementError, match="needs a DVC remote that both machines reach"):
        placed_stage.fn("train", "gpu", str(pushed))


def test_only_stages_whose_inputs_travel_can_be_placed(pushed: Path) -> None:
    stages = load_stages(pushed)
    for stage in ("preprocess", "train", "evaluate", "export"):  # the commit's files and upstream cached outputs
        _check_inputs(pushed, stage, stages)
    with pytest.raises(PlacementError, match=r"check_regression cannot be placed: it reads reports/export.json"):
        _check_inputs(pushed, "check_regression", stages)


def test_weights_that_dvc_tracks_travel_with_a_placed_train(pushed: Path) -> None:
    """train depends on models/pretrained: its .dvc-tracked weights reach the pool's machine by dvc push/pull;
    a file there that neither git nor DVC tracks would not, so train cannot be placed with it."""
    stages = load_stages(pushed)
    assert dvc_files_in_deps(pushed, "train", stages) == []
    weights = pushed / "models/pretrained/resnet18-f37072fd.pth"
    weights.write_bytes(b"weights")
    with pytest.raises(PlacementError, match="train cannot be placed: it reads models/pretrained"):
        _check_inputs(pushed, "train", stages)
    dvc("add", "models/pretrained/resnet18-f37072fd.pth", cwd=pushed)
    commit(pushed, "weights")
    assert dvc_files_in_deps(pushed, "train", stages) == ["models/pretrained/resnet18-f37072fd.pth.dvc"]
    _check_inputs(pushed, "train", stages)


def test_placement_names_only_stages_of_dvc_yaml(pushed: Path) -> None:
    stages = load_stages(pushed)
    check_placement({"train": "gpu"}, stages)
    with pytest.raises(ValueError, match=r"placement names stage 'trian', which dvc.yaml does not have \(generate"):
        check_placement({"trian": "gpu"}, stages)
    with pytest.raises(ValueError, match="'' is not a work pool name"):
        check_placement({"train": ""}, stages)


def test_changed_files_keeps_whole_names(pushed: Path) -> None:
    (pushed / "dvc.yaml").write_text((pushed / "dvc.yaml").read_text() + "\n")  # " M dvc.yaml": leading blank
    (pushed / "params.yaml").unlink()
    assert sorted(changed_files(pushed)) == ["dvc.yaml", "params.yaml"]


def test_what_runs_write_is_sent_or_allowed(pushed: Path) -> None:
    allowed = written_by_runs(pushed, load_stages(pushed))
    assert {"dvc.lock", "params.yaml", "reports/train_run.json", "reports/metrics.json", "models/.gitignore"} <= allowed
    assert "reports/run_manifest.json" in allowed and not any(path.startswith("tasks/") for path in allowed)


def test_uncommitted_code_or_an_unpushed_commit_is_refused_by_name(pushed: Path) -> None:
    (pushed / "params.yaml").write_text((pushed / "params.yaml").read_text().replace("epochs: 1", "epochs: 2"))
    assert _commit_on_remote(pushed, "origin", "gpu") == sh(["git", "rev-parse", "HEAD"], cwd=pushed).stdout.strip()

    train = pushed / "tasks" / "train.py"
    train.write_text(train.read_text() + "\n# an edit\n")
    with pytest.raises(PlacementError, match=r"uncommitted changes to tasks/train.py: the gpu machine runs commit"):
        _commit_on_remote(pushed, "origin", "gpu")

    commit(pushed, "an edit, not pushed")
    with pytest.raises(PlacementError, match=r"is on no branch of git remote 'origin': `git push` it first"):
        _commit_on_remote(pushed, "origin", "gpu")
