"""make add-data: a user's ImageFolder becomes DVC-tracked data of the project, with one clear line for
every bad input and nothing left half-done. A real git + DVC repository, the real make target."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helpers.folders import make_imagefolder
from tests.helpers.project import ROOT, commit, dvc, env_with_venv, make_command, make_project, sh


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
        ("add-data", f"SRC={src}"): "error: NAME or INTO is missing",
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


# make add-data INTO=: growing a tracked dataset.


def snapshot(repo: Path) -> dict[str, bytes]:
    """Every file of data/raw/ (the dataset, its .dvc file, .gitignore, any staging left behind), by path."""
    raw = repo / "data" / "raw"
    return {p.relative_to(raw).as_posix(): p.read_bytes() for p in sorted(raw.rglob("*")) if p.is_file()}


def renamed(folder: Path, prefix: str) -> Path:
    """make_imagefolder names files 000.jpg, 001.png...: other names, so a merge does not collide with them."""
    for path in sorted(folder.rglob("*.*")):
        path.rename(path.with_name(prefix + path.name))
    return folder


def meta_merges(repo: Path, name: str = "pets") -> list[dict[str, object]]:
    return yaml.safe_load((repo / "data" / "raw" / f"{name}.dvc").read_text())["meta"]["merges"]


@pytest.fixture
def tracked(repo: Path, tmp_path: Path) -> Path:
    """`repo` with data/raw/pets (3 classes x 4 images) added by NAME= (data.source) and committed."""
    src = make_imagefolder(tmp_path / "pets", classes=3, per_class=4)
    proc = make(repo, "add-data", f"SRC={src}", "NAME=pets")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    commit(repo, "pets")
    return repo


def test_into_merges_new_images_and_keeps_the_old(tracked: Path, tmp_path: Path) -> None:
    repo, dest = tracked, tracked / "data" / "raw" / "pets"
    old = {p.relative_to(dest): p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    new = renamed(make_imagefolder(tmp_path / "new", classes=4, per_class=3, seed=1), "n")  # class_3 is new
    shutil.copy2(dest / "class_1" / "001.png", new / "class_1" / "again.png")  # same bytes, same class: skipped
    (new / "class_2" / "notes.txt").write_text("not an image")
    params, src_files = (repo / "params.yaml").read_bytes(), sorted(new.rglob("*"))
    dvc_before = (dest.parent / "pets.dvc").read_text()

    proc = make(repo, "add-data", f"SRC={new}", "INTO=pets")

    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all((dest / rel).read_bytes() == data for rel, data in old.items())  # the old images, untouched
    added = sorted(p.relative_to(new) for p in new.rglob("n0*"))
    assert all((dest / rel).read_bytes() == (new / rel).read_bytes() for rel in added)
    assert not (dest / "class_1" / "again.png").exists() and not (dest / "class_2" / "notes.txt").exists()
    assert sum(1 for p in dest.rglob("*") if p.is_file()) == len(old) + 12
    assert (repo / "params.yaml").read_bytes() == params  # data.source unchanged
    assert sorted(new.rglob("*")) == src_files  # an ordinary SRC is only read
    tracked_out = yaml.safe_load((dest.parent / "pets.dvc").read_text())["outs"][0]
    assert tracked_out["nfiles"] == 24 and (dest.parent / "pets.dvc").read_text() != dvc_before
    (entry,) = meta_merges(repo)
    assert entry["added"] == 12 and entry["skipped"] == 1 and entry["classes_new"] == ["class_3"]
    assert entry["classes"]["class_1"] == {"added": 3, "skipped": 1}
    assert sum(entry["splits"].values()) == 12 and set(entry["splits"]) == {"train", "val", "test"}
    assert "/" not in yaml.safe_dump(entry)  # no paths in the record
    assert "12 added, 1 skipped" in proc.stdout and "1 ignored" in proc.stdout
    assert "new class folder(s) ['class_3']" in proc.stdout and "make promote" in proc.stdout
    assert dvc("status", "--json", "data/raw/pets.dvc", cwd=repo).stdout.strip() in ("", "{}")
    assert "data/raw/pets.dvc" in sh(["git", "status", "--porcelain"], cwd=repo).stdout  # a new version to commit
    assert sh(["git", "show", "HEAD:data/raw/pets.dvc"], cwd=repo).stdout == dvc_before  # the old one in history

    again = make(repo, "add-data", f"SRC={new}", "INTO=pets")  # everything is there now
    assert again.returncode == 0 and "0 added, 13 skipped" in again.stdout and "nothing new" in again.stdout
    assert len(meta_merges(repo)) == 1


def test_conflicts_are_refused_before_anything_is_copied(tracked: Path, tmp_path: Path) -> None:
    repo, dest = tracked, tracked / "data" / "raw" / "pets"
    before = snapshot(repo)
    cases = {}
    path_clash = renamed(make_imagefolder(tmp_path / "a", classes=2, per_class=3, seed=1), "n")
    (path_clash / "class_0" / "n000.jpg").rename(path_clash / "class_0" / "000.jpg")  # other bytes, existing name
    cases[path_clash] = f"SRC file {path_clash / 'class_0' / '000.jpg'} would overwrite data/raw/pets/class_0/000.jpg"
    two_labels = renamed(make_imagefolder(tmp_path / "b", classes=2, per_class=3, seed=2), "n")
    shutil.copy2(dest / "class_0" / "002.jpg", two_labels / "class_1" / "relabelled.jpg")
    cases[two_labels] = (f"SRC file {two_labels / 'class_1' / 'relabelled.jpg'} (class class_1) has the same bytes "
                         f"as data/raw/pets/class_0/002.jpg (class class_0)")  # fmt: skip
    inside = renamed(make_imagefolder(tmp_path / "c", classes=2, per_class=2, seed=3), "n")
    shutil.copy2(inside / "class_0" / "n000.jpg", inside / "class_1" / "copy.jpg")
    cases[inside] = "(class class_0): one image cannot have two labels; keep one"
    for src, message in cases.items():
        proc = make(repo, "add-data", f"SRC={src}", "INTO=pets")
        assert proc.returncode == 2, (src, proc.stdout, proc.stderr)
        assert message in proc.stderr and "nothing was added" in proc.stderr, proc.stderr
        assert len([line for line in proc.stderr.splitlines() if "error:" in line]) == 1
        assert snapshot(repo) == before  # no file copied, the .dvc file as it was, no staging left


def write_review(review: Path, src: Path) -> dict[str, Path]:
    """The server's review folder: <predicted class>/<sha256>.<ext> + <sha256>.json, as serving's ReviewFolder."""
    from tasks.core.io import sha256_file

    saved = {}
    for path in sorted(src.rglob("*.*")):
        digest = sha256_file(path)
        target = review / path.parent.name / f"{digest}{path.suffix}"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
        target.with_suffix(".json").write_text(json.dumps({"predicted": path.parent.name}))
        saved[path.parent.name + "/" + path.name] = target
    return saved


def test_the_review_folder_is_taken_in_and_emptied_of_what_was_taken(tracked: Path, tmp_path: Path) -> None:
    repo, dest = tracked, tracked / "data" / "raw" / "pets"
    review = repo / "data" / "review"  # params.yaml serve.review_dir
    saved = write_review(review, make_imagefolder(tmp_path / "traffic", classes=2, per_class=3, seed=5))
    moved = saved["class_0/000.jpg"]
    relabelled = review / "class_1" / moved.name  # a person moved the image, not its sidecar
    moved.rename(relabelled)
    shutil.copy2(dest / "class_1" / "001.png", review / "class_1" / "already-there.png")  # a duplicate: taken too
    (review / "README.txt").write_text("notes of the reviewer")  # not taken: stays
    unrelated = review / "class_1" / "notes.json"
    unrelated.write_text("{}")  # a .json that is no taken image's sidecar: stays
    discarded = review / ".discarded" / "class_0"  # the review page's discard of the same bytes: stays, sidecar too
    discarded.mkdir(parents=True)
    shutil.copy2(relabelled, discarded / moved.name)
    shutil.copy2(moved.with_suffix(".json"), discarded / f"{moved.stem}.json")
    kept = sorted(p.relative_to(review).as_posix() for p in (review / ".discarded").rglob("*"))

    proc = make(repo, "add-data", "SRC=data/review", "INTO=pets")

    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (dest / "class_1" / moved.name).read_bytes() == (tmp_path / "traffic" / "class_0" / "000.jpg").read_bytes()
    assert not list(dest.rglob("*.json"))  # no sidecar came in
    assert sorted(p.relative_to(review).as_posix() for p in review.rglob("*")) == sorted([
        "README.txt", "class_1", "class_1/notes.json", ".discarded", *kept])  # fmt: skip
    assert "6 added, 1 skipped" in proc.stdout and "7 image(s) and 6 sidecar(s) taken out" in proc.stdout
    (entry,) = meta_merges(repo)
    assert entry["from_review"] is True and entry["classes"]["class_1"] == {"added": 4, "skipped": 1}
    assert dvc("status", "--json", "data/raw/pets.dvc", cwd=repo).stdout.strip() in ("", "{}")


def test_into_a_split_dataset_goes_to_train_and_splits_as_preprocess(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each added image's split, as the merge recorded it, is the split preprocess gives it."""
    from tasks.core.io import read_json
    from tasks.core.params import load_params
    from tasks.images.shards import MANIFEST
    from tasks.preprocess import run as preprocess
    from tasks.tools import add_data

    kaggle = tmp_path / "kaggle"
    make_imagefolder(kaggle / "train", classes=3, per_class=6)
    renamed(make_imagefolder(kaggle / "test", classes=3, per_class=2, seed=9), "t")
    assert make(repo, "add-data", f"SRC={kaggle}", "NAME=kaggle").returncode == 0
    new = renamed(make_imagefolder(tmp_path / "new", classes=3, per_class=12, seed=4), "n")
    monkeypatch.chdir(repo)
    params = load_params(repo / "params.yaml")  # data.source is data/raw/kaggle now

    dest = add_data.grow(new, "kaggle", params=params)

    assert sorted(p.name for p in dest.iterdir()) == ["test", "train"]
    assert sorted(p.relative_to(dest / "train") for p in dest.rglob("n*")) == sorted(
        p.relative_to(new) for p in new.rglob("*.*"))  # fmt: skip
    (entry,) = meta_merges(repo, "kaggle")
    assert entry["split_rule"]["fixed"] == ["test"] and entry["splits"]["test"] == 0  # test is its folder's
    assert entry["splits"]["val"] > 0  # hash-split off train: else this test could not tell
    section = params.preprocess.model_copy(update={"image_size": 16, "workers": 1, "resize": "squash"})
    preprocess(section, seed=params.seed, source=dest, out_dir=tmp_path / "shards")
    files = read_json(tmp_path / "shards" / MANIFEST)["files"]
    splits = [f["split"] for f in files if f["path"].split("/")[-1].startswith("n")]
    assert len(splits) == 36 and {s: splits.count(s) for s in ("train", "val", "test")} == entry["splits"]


@pytest.mark.slow  # the default suite's budget (issue 59 item 4): make test-slow runs it
def test_bad_into_inputs_get_one_line_and_change_nothing(tracked: Path, tmp_path: Path) -> None:
    repo, dest = tracked, tracked / "data" / "raw" / "pets"
    new = renamed(make_imagefolder(tmp_path / "new", classes=2, per_class=2, seed=1), "n")
    empty = tmp_path / "empty"
    (empty / "cat").mkdir(parents=True)
    (empty / "cat" / "notes.txt").write_text("no image")
    split_src = tmp_path / "split"
    renamed(make_imagefolder(split_src / "train", classes=2, per_class=1, seed=2), "s")
    make_imagefolder(repo / "data" / "raw" / "loose", classes=2, per_class=1)  # in data/raw/, never dvc-added
    inner = dest / "class_0"
    cases = {
        (f"SRC={new}",): "error: NAME or INTO is missing",
        (f"SRC={new}", "NAME=x", "INTO=pets"): "error: NAME=x and INTO=pets both given",
        (f"SRC={new}", "INTO=../up"): "INTO '../up': use letters, digits",
        (f"SRC={new}", "INTO=nope"): "INTO nope: no dataset data/raw/nope",
        (f"SRC={new}", "INTO=loose"): "INTO loose: data/raw/loose is not tracked by DVC (no data/raw/loose.dvc)",
        (f"SRC={inner}", "INTO=pets"): f"SRC {inner}: inside data/raw/pets, the dataset it would grow",
        (f"SRC={repo / 'data'}", "INTO=pets"): f"SRC {repo / 'data'}: contains data/raw/pets",
        (f"SRC={empty}", "INTO=pets"): f"SRC {empty}: no images in its class folders",
        (f"SRC={split_src}", "INTO=pets"): "but data/raw/pets holds class folders",
        (f"SRC={tmp_path / 'nope'}", "INTO=pets"): f"SRC {tmp_path / 'nope'}: no such folder",
    }
    before = snapshot(repo)
    for args, message in cases.items():
        proc = make(repo, "add-data", *args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert message in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) <= 2  # + make's own line
        assert snapshot(repo) == before, args

    (dest / "class_1" / "000.jpg").write_bytes(b"edited by hand")  # the folder differs from its .dvc file
    before = snapshot(repo)
    proc = make(repo, "add-data", f"SRC={new}", "INTO=pets")
    assert proc.returncode == 2 and "INTO pets: data/raw/pets differs from data/raw/pets.dvc" in proc.stderr
    assert snapshot(repo) == before
    dvc("checkout", "-q", "--force", "data/raw/pets.dvc", cwd=repo)
    shutil.rmtree(dest)  # tracked, but not pulled here
    proc = make(repo, "add-data", f"SRC={new}", "INTO=pets")
    assert proc.returncode == 2 and "`dvc pull data/raw/pets.dvc` brings its images" in proc.stderr


def test_a_failed_dvc_add_leaves_the_dataset_as_it_was(
    tracked: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tasks.core.errors import StageError
    from tasks.core.params import load_params
    from tasks.tools import add_data

    repo = tracked
    review = repo / "data" / "review"
    write_review(review, renamed(make_imagefolder(tmp_path / "traffic", classes=4, per_class=2, seed=5), "r"))
    before, review_before = snapshot(repo), sorted(review.rglob("*"))
    real_run = subprocess.run

    def dvc_add_fails(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        if "add" in args:  # after the images were moved in: the rollback is what is tested
            return subprocess.CompletedProcess(args, 1, "", "ERROR: simulated failure")
        return real_run(args, **kwargs)  # type: ignore[call-overload,no-any-return]

    monkeypatch.chdir(repo)
    monkeypatch.setattr(subprocess, "run", dvc_add_fails)
    with pytest.raises(StageError, match="dvc add data/raw/pets failed, nothing was added"):
        add_data.grow(Path("data/review"), "pets", params=load_params(repo / "params.yaml"))

    assert snapshot(repo) == before  # the moved images gone, the .dvc file as it was
    assert not (repo / "data" / "raw" / "pets" / "class_3").exists()  # the new class folder too
    assert sorted(review.rglob("*")) == review_before  # nothing taken out of the review folder


@pytest.mark.parametrize(
    "wrapped", ["training_set/training_set", "dataset"], ids=["kaggle-wrapped-splits", "top-wrapper"]
)
def test_into_a_wrapped_dataset_lands_where_preprocess_reads_its_classes(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wrapped: str
) -> None:
    """Cats-and-dogs style `training_set/training_set/<class>` (and a lone top wrapper): the merged images go
    into the class folders below the wrappers, so no wrapper turns into a class of its own."""
    from tasks.core.io import read_json
    from tasks.core.params import load_params
    from tasks.images.layout import read_layout
    from tasks.images.shards import MANIFEST
    from tasks.preprocess import run as preprocess
    from tasks.tools import add_data

    src = tmp_path / "wd"
    make_imagefolder(src / wrapped, classes=3, per_class=6)
    if wrapped.startswith("training_set"):
        renamed(make_imagefolder(src / "test_set" / "test_set", classes=3, per_class=2, seed=9), "t")
    assert make(repo, "add-data", f"SRC={src}", "NAME=wd").returncode == 0
    commit(repo, "wd")
    new = renamed(make_imagefolder(tmp_path / "new", classes=3, per_class=5, seed=4), "n")
    monkeypatch.chdir(repo)
    params = load_params(repo / "params.yaml")

    dest = add_data.grow(new, "wd", params=params)

    layout = read_layout(dest)
    assert layout.class_names == ("class_0", "class_1", "class_2")
    train = dest / wrapped
    assert sorted(p.relative_to(train) for p in train.rglob("n*")) == sorted(
        p.relative_to(new) for p in new.rglob("*.*"))  # fmt: skip
    section = params.preprocess.model_copy(update={"image_size": 16, "workers": 1, "resize": "squash"})
    preprocess(section, seed=params.seed, source=dest, out_dir=tmp_path / "shards")
    manifest = read_json(tmp_path / "shards" / MANIFEST)
    assert manifest["class_names"] == ["class_0", "class_1", "class_2"]
    merged = sorted((f["path"], manifest["class_names"][f["label"]]) for f in manifest["files"]
                    if f["path"].split("/")[-1].startswith("n"))  # fmt: skip
    assert merged == sorted((p.relative_to(new).as_posix(), p.parent.name) for p in new.rglob("*.*"))
