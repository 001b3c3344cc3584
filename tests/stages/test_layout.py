"""A data.source already split into train/val/test folders (ImageNet's, Kaggle's and Ultralytics' layout) is read
as its splits, never as three classes named after them; a flat class folder behaves as before."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from tasks import preprocess
from tasks.core.errors import StageError
from tasks.core.io import read_json
from tasks.core.params import DataParams, PreprocessParams
from tasks.images.layout import check_data_folders, read_layout
from tasks.tools import add_data
from tests.helpers.folders import make_imagefolder

pytestmark = pytest.mark.fast

PARAMS = PreprocessParams(image_size=16, workers=2, val_fraction=0.2, test_fraction=0.2)


def split_folder(root: Path, names: dict[str, str], classes: int = 3, per_class: int = 8) -> Path:
    """root/<split folder>/class_<i>/<image>, each split drawn with its own seed (distinct bytes)."""
    for seed, (folder, _) in enumerate(names.items()):
        make_imagefolder(root / folder, classes=classes, per_class=per_class, seed=10 + seed)
    return root


def test_split_folders_are_the_splits(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    source = split_folder(tmp_path / "glyphs", {"Train": "train", "valid": "val", "TEST": "test"})
    caplog.set_level(logging.INFO)
    result = preprocess.run(PARAMS, seed=1, source=source, out_dir=tmp_path / "shards")
    assert result.class_names == ("class_0", "class_1", "class_2")  # not ('TEST', 'Train', 'valid')
    manifest = read_json(tmp_path / "shards" / "manifest.json")
    by_root = {}
    for entry in manifest["files"]:
        by_root.setdefault(entry["root"], set()).add(entry["split"])
    assert by_root == {"source": {"train"}, "val_source": {"val"}, "test_source": {"test"}}
    assert result.split_counts == {"train": 24, "val": 24, "test": 24}
    layout = manifest["layout"]
    assert layout["kind"] == "split folders"
    assert layout["folders"] == {  # relative: no machine's path in the manifest
        "source": "data.source/Train",
        "val_source": "data.source/valid",
        "test_source": "data.source/TEST",
    }
    assert manifest["split_rule"]["val"] == "folder valid" and manifest["split_rule"]["test"] == "folder TEST"
    assert manifest["split_rule"]["val_fraction"] == 0.0 == manifest["split_rule"]["test_fraction"]
    assert "split folders, since its top-level folders are split names: Train (train), valid (val), TEST (test)" in (
        caplog.text
    )


def test_train_and_test_without_val_splits_val_off_train_by_hash(tmp_path: Path) -> None:
    source = split_folder(tmp_path / "data", {"train": "train", "test": "test"}, per_class=20)
    preprocess.run(PARAMS, seed=1, source=source, out_dir=tmp_path / "shards")
    manifest = read_json(tmp_path / "shards" / "manifest.json")
    splits = {(f["root"], f["split"]) for f in manifest["files"]}
    assert splits == {("source", "train"), ("source", "val"), ("test_source", "test")}
    assert manifest["split_rule"]["val"] == "hash range" and manifest["split_rule"]["test"] == "folder test"
    # The same hash range as a flat folder of those training images with the test set fixed elsewhere.
    flat = preprocess.run(PARAMS, seed=1, source=source / "train", test_source=source / "test",
                          out_dir=tmp_path / "flat")  # fmt: skip
    flat_val = {f["path"] for f in read_json(flat.out_dir / "manifest.json")["files"] if f["split"] == "val"}
    assert flat_val == {f["path"] for f in manifest["files"] if f["split"] == "val"} != set()


def test_a_class_missing_from_val_or_test_is_named_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = split_folder(tmp_path / "data", {"train": "train", "val": "val", "test": "test"})
    shutil.rmtree(source / "val" / "class_2")
    shutil.rmtree(source / "test" / "class_1")
    result = preprocess.run(PARAMS, seed=1, source=source, out_dir=tmp_path / "shards")
    assert result.class_names == ("class_0", "class_1", "class_2")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        "val has no folder for class_2; test has no folder for class_1: those classes are not measured" in w
        for w in warned
    ), warned
    assert read_json(tmp_path / "shards" / "manifest.json")["layout"]["missing"] == {
        "val": ["class_2"],
        "test": ["class_1"],
    }


def loose_images(root: Path, split: str) -> Path:
    (root / split).mkdir(parents=True)
    (root / split / "a.png").write_bytes(b"x")
    return root


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (
            lambda r: split_folder(r, {"train": "t", "cats": "c"}),
            r"mix split names \(train\) with other names \(cats\); expected root/<class>/<image>, or root/<split>",
        ),
        (lambda r: split_folder(r, {"val": "v", "test": "t"}), r"split folders test, val but no train folder"),
        (
            lambda r: split_folder(r, {"train": "t", "val": "v", "Validation": "v"}),
            r"folders Validation and val are both the val split",
        ),
        (
            lambda r: loose_images(r, "train"),
            r"train folder .*/train: found 0 class folder\(s\), need at least 1 .*its 1 image file\(s\) outside",
        ),
        (
            lambda r: split_folder(r, {"train": "t", "test": "t"}, classes=1),
            r"split folders hold 1 class folder\(s\) \['class_0'\], need at least 2",
        ),
    ],
    ids=["mixed", "no-train", "two-vals", "images-not-classes", "one-class"],
)
def test_unreadable_layouts_are_one_line_and_write_nothing(tmp_path: Path, make, expected: str) -> None:
    source = make(tmp_path / "data")
    with pytest.raises(StageError, match=expected):
        preprocess.run(PARAMS, seed=1, source=source, out_dir=tmp_path / "shards")
    assert not (tmp_path / "shards").exists()
    with pytest.raises(StageError, match=expected):  # the generate stage's preflight says the same
        check_data_folders(DataParams(source=source), tmp_path / "generated")


def test_a_class_only_in_val_or_test_is_refused(tmp_path: Path) -> None:
    source = split_folder(tmp_path / "data", {"train": "train", "test": "test"})
    make_imagefolder(tmp_path / "extra", classes=4, per_class=2)
    shutil.move(tmp_path / "extra" / "class_3", source / "test" / "zebra")
    with pytest.raises(StageError, match=r"train: no folder for classes \['zebra'\], which test has"):
        preprocess.run(PARAMS, seed=1, source=source, out_dir=tmp_path / "shards")


def test_a_test_folder_and_data_test_source_together_are_refused(tmp_path: Path) -> None:
    source = split_folder(tmp_path / "data", {"train": "train", "test": "test"})
    other = make_imagefolder(tmp_path / "other", classes=3, per_class=2)
    with pytest.raises(StageError, match=r"data.test_source .*other: data.source .* has its own test folder"):
        read_layout(source, other)
    # Without a test folder, data.test_source is the test split as for class folders.
    only_train = split_folder(tmp_path / "only", {"train": "train"})
    layout = read_layout(only_train, other)
    assert dict(layout.roots) == {"source": only_train / "train", "test_source": other}


def test_a_duplicate_across_split_folders_is_kept_in_test_then_val(tmp_path: Path) -> None:
    source = split_folder(tmp_path / "data", {"train": "train", "val": "val", "test": "test"})
    shutil.copy(source / "test" / "class_0" / "001.png", source / "train" / "class_0" / "leak.png")
    shutil.copy(source / "val" / "class_1" / "002.jpg", source / "train" / "class_1" / "leak.jpg")
    preprocess.run(PARAMS, seed=1, source=source, out_dir=tmp_path / "shards")
    refused = {(q["root"], q["path"]): q["reason"] for q in read_json(tmp_path / "shards" / "quarantine.json")[
        "quarantined"]}  # fmt: skip
    assert refused == {("source", "class_0/leak.png"): "duplicate", ("source", "class_1/leak.jpg"): "duplicate"}


def test_add_data_accepts_split_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = split_folder(tmp_path / "kaggle", {"train": "train", "val": "val", "test": "test"}, per_class=2)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("data:\n  source: data/generated\n")
    import subprocess
    import sys

    subprocess.run(["git", "init", "-q"], check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], check=True)
    dest = add_data.run(source, "kaggle", raw_dir=Path("data/raw"), params_file=Path("params.yaml"))
    assert sorted(p.name for p in dest.iterdir()) == ["test", "train", "val"]
    assert read_layout(dest).kind == "split folders"
    assert "source: data/raw/kaggle" in (tmp_path / "params.yaml").read_text()


def _pngs(folder: Path, count: int) -> None:
    """Loose images with no class folder: an unlabelled folder (Intel scenes' seg_pred)."""
    from PIL import Image

    folder.mkdir(parents=True)
    for i in range(count):
        Image.new("RGB", (20, 20), (i * 40, 10, 10)).save(folder / f"{i}.png")


@pytest.mark.parametrize(
    ("build", "roots", "wrappers", "unlabelled"),
    [
        (  # the Kaggle brain-MRI layout
            lambda r: split_folder(r, {"Training": "train", "Testing": "test"}),
            {"source": "data.source/Training", "test_source": "data.source/Testing"}, None, None,
        ),
        (  # cats and dogs: each split folder wraps a folder of the same name
            lambda r: split_folder(r, {"training_set/training_set": "train", "test_set/test_set": "test"}),
            {"source": "data.source/training_set/training_set", "test_source": "data.source/test_set/test_set"},
            ["training_set/training_set", "test_set/test_set"], None,
        ),
        (  # Intel scenes: wrapped splits and an unlabelled seg_pred/seg_pred of loose images
            lambda r: (split_folder(r, {"seg_train/seg_train": "train", "seg_test/seg_test": "test"}),
                       _pngs(r / "seg_pred" / "seg_pred", 4), r)[-1],
            {"source": "data.source/seg_train/seg_train", "test_source": "data.source/seg_test/seg_test"},
            ["seg_train/seg_train", "seg_test/seg_test"], ["seg_pred"],
        ),
        (  # one dataset/ folder above train/ val/ test/
            lambda r: split_folder(r, {"dataset/train": "train", "dataset/val": "val", "dataset/test": "test"}),
            {"source": "data.source/dataset/train", "val_source": "data.source/dataset/val",
             "test_source": "data.source/dataset/test"},
            ["dataset"], None,
        ),
    ],
    ids=["Training-Testing", "training_set-test_set", "seg_train-seg_test-seg_pred", "dataset-wrapper"],
)  # fmt: skip
def test_the_layouts_public_datasets_ship_are_read_as_splits_with_the_true_classes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, build, roots, wrappers, unlabelled
) -> None:
    source = build(tmp_path / "data")
    caplog.set_level(logging.INFO)
    result = preprocess.run(PARAMS, seed=1, source=source, out_dir=tmp_path / "shards")
    assert result.class_names == ("class_0", "class_1", "class_2")  # never the folders' names
    layout = read_json(tmp_path / "shards" / "manifest.json")["layout"]
    assert layout["kind"] == "split folders" and layout["folders"] == roots
    assert layout.get("wrappers") == wrappers and layout.get("unlabelled") == unlabelled
    if wrappers:
        assert f"descended into {', '.join(wrappers)}" in layout["why"] and "descended into" in caplog.text
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "ignored" in r.getMessage()]
    assert len(warnings) == (1 if unlabelled else 0), warnings
    if unlabelled:
        assert "ignored seg_pred beside the split folders: images without class folders" in warnings[0]


def test_class_folders_that_all_hold_only_folders_are_refused_naming_them(tmp_path: Path) -> None:
    """Folders of folders are splits or wrappers under names nobody listed, never classes named after folders."""
    source = tmp_path / "data"
    make_imagefolder(source / "part_a", classes=2, per_class=4, seed=1)
    make_imagefolder(source / "part_b", classes=2, per_class=4, seed=2)
    expected = (
        r"its folders part_a, part_b hold only folders, no images of their own: they look like splits or wrappers"
    )
    with pytest.raises(StageError, match=expected):
        preprocess.run(PARAMS, seed=1, source=source, out_dir=tmp_path / "shards")
    assert not (tmp_path / "shards").exists()
    with pytest.raises(StageError, match=r"train folder .* hold only folders"):  # inside a split folder too
        wrapped = split_folder(tmp_path / "split", {"train/a": "t", "train/b": "t", "test/a": "t"})
        preprocess.run(PARAMS, seed=1, source=wrapped, out_dir=tmp_path / "shards")
