"""Content-hash splits on the default data, and the optional fixed test folder (data.test_source)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tasks import generate, preprocess
from tasks.core.errors import StageError
from tasks.core.io import read_json
from tasks.core.params import DataParams, GenerateParams, PreprocessParams
from tasks.images.shards import ShardSplit
from tasks.images.validation import fixed_test_folder
from tests.helpers.folders import make_imagefolder

pytestmark = pytest.mark.fast  # unit-level: make test-fast

PARAMS = PreprocessParams(image_size=16, workers=2, val_fraction=0.1, test_fraction=0.1)


def splits_by_path(shards: Path) -> dict[str, str]:
    return {f["path"]: f["split"] for f in read_json(shards / "manifest.json")["files"]}


def test_adding_100_images_to_the_default_data_moves_none(tmp_path: Path) -> None:
    """The generated default dataset: image i of a class depends only on (seed, class, i), so 22 per
    class is the 12-per-class folder plus 100 new images."""
    small = GenerateParams(images_per_class=12, min_side=24, max_side=48, workers=1)
    generate.run(small, seed=42, out_dir=tmp_path / "before")
    generate.run(small.model_copy(update={"images_per_class": 22}), seed=42, out_dir=tmp_path / "after")
    preprocess.run(PARAMS, seed=42, source=tmp_path / "before", out_dir=tmp_path / "s1")
    preprocess.run(PARAMS, seed=42, source=tmp_path / "after", out_dir=tmp_path / "s2")
    before, after = splits_by_path(tmp_path / "s1"), splits_by_path(tmp_path / "s2")
    assert len(before) == 120 and len(after) == 220
    assert {path: after[path] for path in before} == before
    assert set(after.values()) == {"train", "val", "test"}
    # A different seed gives a different split: the split is (bytes, seed), not a fixed table.
    preprocess.run(PARAMS, seed=7, source=tmp_path / "before", out_dir=tmp_path / "s3")
    assert splits_by_path(tmp_path / "s3") != before


def test_renaming_a_file_keeps_its_split(imagefolder: Path, tmp_path: Path) -> None:
    preprocess.run(PARAMS, seed=1, source=imagefolder, out_dir=tmp_path / "a")
    split = splits_by_path(tmp_path / "a")["class_0/003.png"]
    (imagefolder / "class_0" / "003.png").rename(imagefolder / "class_0" / "renamed.png")
    preprocess.run(PARAMS, seed=1, source=imagefolder, out_dir=tmp_path / "b")
    assert splits_by_path(tmp_path / "b")["class_0/renamed.png"] == split


@pytest.fixture
def with_test_folder(tmp_path: Path) -> tuple[Path, Path]:
    source = make_imagefolder(tmp_path / "source", classes=3, per_class=20, seed=1)
    test = make_imagefolder(tmp_path / "test", classes=2, per_class=6, seed=2)  # a subset of the classes
    shutil.copy(source / "class_0" / "004.jpg", test / "class_0" / "copied_from_source.jpg")
    return source, test


def test_fixed_test_folder_is_the_test_split(with_test_folder: tuple[Path, Path], tmp_path: Path) -> None:
    source, test = with_test_folder
    result = preprocess.run(PARAMS, seed=1, source=source, out_dir=tmp_path / "shards", test_source=test)
    manifest = read_json(tmp_path / "shards" / "manifest.json")
    by_root = {(f["root"], f["path"]): f for f in manifest["files"]}
    assert all(f["split"] == "test" for (root, _), f in by_root.items() if root == "test_source")
    assert all(f["split"] != "test" for (root, _), f in by_root.items() if root == "source")
    assert result.split_counts["test"] == 13 == len(ShardSplit.open(tmp_path / "shards", "test"))
    # The source copy of a test image is refused, so the test image is never trained on.
    report = read_json(tmp_path / "shards" / "quarantine.json")
    refused = {(q["root"], q["path"]): q["reason"] for q in report["quarantined"]}
    assert refused == {("source", "class_0/004.jpg"): "duplicate"}
    # The test set is frozen by hash in the manifest.
    test_hashes = sorted(f["sha256"] for f in manifest["files"] if f["split"] == "test")
    assert manifest["test_set"]["files"] == test_hashes and manifest["test_set"]["count"] == 13
    assert manifest["split_rule"]["test"] == "data.test_source"
    # val is the same hash range with or without the test folder.
    preprocess.run(PARAMS, seed=1, source=source, out_dir=tmp_path / "plain")
    plain = {f["path"]: f["split"] for f in read_json(tmp_path / "plain" / "manifest.json")["files"]}
    assert {p for p, s in plain.items() if s == "val"} == {
        p for (r, p), f in by_root.items() if r == "source" and f["split"] == "val"
    }


def test_bad_test_folders_are_clear_errors(with_test_folder: tuple[Path, Path], tmp_path: Path) -> None:
    source, test = with_test_folder
    (test / "zebra").mkdir()
    with pytest.raises(StageError, match=r"test_source .*class folders \['zebra'\] are not classes of data.source"):
        preprocess.run(PARAMS, seed=1, source=source, out_dir=tmp_path / "out", test_source=test)
    with pytest.raises(StageError, match="overlap"):
        preprocess.run(PARAMS, seed=1, source=source, out_dir=tmp_path / "out", test_source=source / "class_0")
    assert not (tmp_path / "out").exists()


def test_test_source_left_at_generated_means_none() -> None:
    generated = Path("data/generated")
    assert fixed_test_folder(DataParams(), generated) is None
    assert fixed_test_folder(DataParams(test_source=Path("my/test")), generated) == Path("my/test")


@pytest.mark.parametrize("same_size", [True, False], ids=["hashed-in-pass-1", "sized-in-pass-1"])
def test_a_file_changed_between_the_passes_stops_the_stage(
    same_size: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pass 1 hashes only files whose size another file shares; the rest are hashed as they are
    decoded. A file rewritten in between (other bytes, same size / another size) is caught either way."""
    source = make_imagefolder(tmp_path / "images", classes=2, per_class=6)
    victim = sorted((source / "class_0").iterdir())[0]
    data = victim.read_bytes()
    if same_size:
        (source / "class_1" / "twin.bin.png").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # a size twin
    sizes = [p.stat().st_size for p in source.rglob("*") if p.is_file()]
    assert (sizes.count(len(data)) > 1) == same_size
    real_plan = preprocess.plan

    def plan_then_rewrite(*args, **kwargs):  # runs between pass 1 (hash/size) and pass 2 (decode)
        todo = real_plan(*args, **kwargs)
        victim.write_bytes(data[:-1] + bytes([data[-1] ^ 2]) if same_size else data + b"\0")
        return todo

    monkeypatch.setattr(preprocess, "plan", plan_then_rewrite)
    with pytest.raises(StageError, match=rf"{victim.name}: changed while preprocessing ran"):
        preprocess.run(PARAMS, seed=42, source=source, out_dir=tmp_path / "shards")
    assert not (tmp_path / "shards").exists()
