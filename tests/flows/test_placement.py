"""Placement's checks before anything is sent (flows/placement/), on real git repositories; the whole
round trip across two checkouts is tests/flows/test_placement_e2e.py (slow)."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest

from flows.placement.git import changed_files, check_git_remote, dvc_files_in_deps, written_by_runs
from flows.placement.protocol import PlacementError, check_dvc_remote, check_placement
from flows.placement.send import _check_inputs, _commit_on_remote, placed_stage
from tasks.core.dag import load_stages
from tests.helpers.project import ROOT, commit, dvc, make_project, sh


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
    with pytest.raises(
        ValueError, match=r"placement names stage 'trian', which dvc.yaml does not have \(environment, generate"
    ):
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


# --- run-stage takes only what it needs: hostile parameters are refused before git or DVC sees them ----


def _run_stage(repo: Path, **parameters: object) -> None:
    from prefect.logging import disable_run_logger

    from flows.placement.receive import run_stage_flow

    with disable_run_logger(), contextlib.chdir(repo):
        run_stage_flow.fn(**{"stage": "train", "files": {}, **parameters})


def test_run_stage_refuses_hostile_parameters_and_runs_nothing(pushed: Path, tmp_path: Path) -> None:
    from flows.placement.receive import run_stage_flow

    marker = tmp_path / "MARKER"
    head = sh(["git", "rev-parse", "HEAD"], cwd=pushed).stdout.strip()
    foreign = make_project(tmp_path / "foreign")  # another repository on the worker, with a commit of its own
    (foreign / "dvc.yaml").write_text(f"stages:\n  train:\n    cmd: touch {marker}\n")
    commit(foreign, "foreign")
    foreign_commit = sh(["git", "rev-parse", "HEAD"], cwd=foreign).stdout.strip()
    refused = {
        f"--upload-pack=touch {marker}": (dict(git_remote=f"--upload-pack=touch {marker}", commit=head),
                                         "is not a git remote"),
        "a URL": (dict(git_remote=f"file://{foreign}", commit=foreign_commit), "is not a git remote"),
        "a path": (dict(git_remote=str(foreign), commit=foreign_commit), "is not a git remote"),
        "a short commit": (dict(commit=head[:12]), "is not a full 40-hex commit id"),
        "an option as the commit": (dict(commit=f"--upload-pack=touch {marker}"), "is not a full 40-hex commit id"),
        "a commit not on the remote": (dict(commit=foreign_commit), "is on no branch of git remote 'origin'"),
        "a DVC remote that is not configured": (dict(commit=head, dvc_remote=f"--config={marker}"),
                                                "is not configured"),
        "another file": (dict(commit=head, files={"dvc.yaml": f"stages: {{x: {{cmd: touch {marker}}}}}"}),
                         "takes only dvc.lock, params.yaml"),
    }  # fmt: skip
    for name, (parameters, message) in refused.items():
        with pytest.raises(PlacementError, match=re.escape(message)):
            _run_stage(pushed, **parameters)
        assert not marker.exists(), name
    params = (pushed / "params.yaml").read_text()
    elsewhere = params.replace("model: models/model.pt", f"model: {marker}")
    with pytest.raises(PlacementError, match=r"changes paths.model: a placed stage reads and writes where the commit"):
        _run_stage(pushed, commit=head, files={"params.yaml": elsewhere})
    rendezvous = params.replace("nnodes: 1", "nnodes: 2")  # ranks unpickle what their peers send
    with pytest.raises(PlacementError, match=r"changes train.nnodes: a placed stage reads and writes"):
        _run_stage(pushed, commit=head, files={"params.yaml": rendezvous})
    with pytest.raises(PlacementError, match=r"the params.yaml sent with this run does not validate"):
        _run_stage(pushed, commit=head, files={"params.yaml": params.replace("epochs: 1", "epochs: -1")})
    assert (pushed / "params.yaml").read_text() == params and not marker.exists()
    # No repo_dir: the worker's checkout is the deployment's working directory, never a parameter.
    with pytest.raises(Exception, match="repo_dir"):
        run_stage_flow.validate_parameters({"stage": "train", "commit": head, "files": {}, "repo_dir": str(foreign)})
    assert sh(["git", "rev-parse", "HEAD"], cwd=pushed).stdout.strip() == head  # nothing was checked out
    assert not marker.exists()


def test_git_and_dvc_get_a_double_dash_before_positional_arguments(pushed: Path) -> None:
    """Even a value that passed the checks cannot turn into an option further down."""
    source = "\n".join(path.read_text() for path in sorted((ROOT / "flows" / "placement").glob("*.py")))
    assert re.findall(r'git\(repo, "(?:fetch|push)"', source)  # the scan below has calls to look at
    for call in re.findall(r'git\(repo, "(?:fetch|push)"[^\n]*', source):
        assert '"--", git_remote' in call, call
    assert '"--", *args[1:]' in source and '"--single-item", "--", stage' in (ROOT / "flows/stage.py").read_text()


def test_the_sending_side_takes_only_configured_remote_names(pushed: Path) -> None:
    assert check_git_remote(pushed, "origin") == "origin"
    with pytest.raises(PlacementError, match=r"git_remote '--upload-pack=x' is not a git remote .*configured: origin"):
        check_git_remote(pushed, "--upload-pack=x")
    with pytest.raises(PlacementError, match=r"DVC remote 's3://bucket' is not configured .*configured: none"):
        check_dvc_remote(pushed, "s3://bucket")
    dvc("remote", "add", "store", str(pushed.parent / "store"), cwd=pushed)
    assert check_dvc_remote(pushed, "store") == "store" and check_dvc_remote(pushed, None) is None
