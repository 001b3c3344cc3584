"""make add-data: a user's ImageFolder becomes DVC-tracked data of the project, with one clear line for
every bad input and nothing left half-done. A real git + DVC repository, the real make target."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helpers.folders import make_imagefolder
from tests.helpers.project import ROOT, env_with_venv, make_command, make_project, sh


def make(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`make add-data ...` in `repo`, with the Makefile and this venv (the repo copy has neither)."""
    return subprocess.run(make_command(*args), cwd=repo, env=env_with_venv(), capture_output=True, text=True,
                          timeout=300)  # fmt: skip


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = make_project(tmp_path / "repo")
    shutil.copy2(ROOT / "params.yaml", repo / "params.yaml")  # the shipped file, comments and all
    return repo


def test_add_data_copies_tracks_and_points_params_at_it(repo: Path, tmp_path: Path) -> None:
    src = make_imagefolder(tmp_path / "pets", classes=3, per_class=4)
    before = (repo / "params.yaml").read_text()
    proc = make(repo, "add-data", f"SRC={src}", "NAME=pets")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    dest = repo / "data" / "raw" / "pets"
    assert sorted(p.relative_to(dest) for p in dest.rglob("*")) == sorted(p.relative_to(src) for p in src.rglob("*"))
    assert all((dest / p.relative_to(src)).read_bytes() == p.read_bytes() for p in src.rglob("*") if p.is_file())
    tracked = yaml.safe_load((repo / "data" / "raw" / "pets.dvc").read_text())
    assert tracked["outs"][0]["path"] == "pets" and tracked["outs"][0]["nfiles"] == 12
    assert "/pets" in (repo / "data" / "raw" / ".gitignore").read_text().splitlines()
    after = (repo / "params.yaml").read_text()
    assert yaml.safe_load(after)["data"]["source"] == "data/raw/pets"
    changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines(), strict=True) if a != b]
    assert len(changed) == 1 and "source:" in changed[0][1]  # only that line; comments and order stay
    assert "git add data/raw/pets.dvc data/raw/.gitignore params.yaml" in proc.stdout
    assert sorted(p.name for p in src.iterdir()) == ["class_0", "class_1", "class_2"]  # SRC untouched
    status = sh(["git", "status", "--porcelain"], cwd=repo).stdout
    assert "data/raw/pets/" not in status  # the images themselves are DVC's, not git's


def test_bad_inputs_get_one_line_and_change_nothing(repo: Path, tmp_path: Path) -> None:
    src = make_imagefolder(tmp_path / "pets", classes=2, per_class=2)
    make_imagefolder(repo / "data", classes=2, per_class=1)  # an ImageFolder that data/raw/x would be inside
    params = (repo / "params.yaml").read_text()
    cases = {
        ("add-data", "NAME=pets"): "error: SRC is missing",
        ("add-data", f"SRC={src}"): "error: NAME is missing",
        ("add-data", f"SRC={tmp_path / 'nope'}", "NAME=x"): f"SRC {tmp_path / 'nope'}: no such folder",
        ("add-data", f"SRC={src / 'class_0'}", "NAME=x"): "found 0 class folder(s), need at least 2",
        ("add-data", f"SRC={src}", "NAME=../up"): "NAME '../up': use letters, digits",
        ("add-data", f"SRC={repo / 'data'}", "NAME=x"): f"SRC {repo / 'data'}: contains data/raw/x",
    }
    for args, message in cases.items():
        proc = make(repo, *args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert message in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr
    assert not (repo / "data" / "raw").exists() and (repo / "params.yaml").read_text() == params

    assert make(repo, "add-data", f"SRC={src}", "NAME=pets").returncode == 0
    params = (repo / "params.yaml").read_text()
    shutil.rmtree(src / "class_1")
    again = make(repo, "add-data", f"SRC={make_imagefolder(tmp_path / 'other')}", "NAME=pets")
    assert again.returncode == 2 and "NAME pets: data/raw/pets already exists" in again.stderr
    assert len(list((repo / "data" / "raw" / "pets").rglob("*.*"))) == 4  # the first copy is intact
    assert (repo / "params.yaml").read_text() == params


def test_an_unversioned_source_is_named_in_a_warning(repo: Path, tmp_path: Path) -> None:
    from tasks.core.params import DataParams
    from tasks.images.validation import unversioned_source

    outside = make_imagefolder(tmp_path / "outside", classes=2, per_class=1)
    warning = unversioned_source(DataParams(source=outside), repo / "data" / "generated", repo)
    assert warning is not None and f"data.source {outside} is not versioned" in warning
    assert unversioned_source(DataParams(), Path("data/generated"), repo) is None  # the generated default
    assert make(repo, "add-data", f"SRC={outside}", "NAME=tracked").returncode == 0
    inside = DataParams(source=repo / "data" / "raw" / "tracked")
    assert unversioned_source(inside, repo / "data" / "generated", repo) is None
    loose = make_imagefolder(repo / "data" / "loose", classes=2, per_class=1)  # in the repo, not dvc-added
    assert unversioned_source(DataParams(source=loose), repo / "data" / "generated", repo) is not None
