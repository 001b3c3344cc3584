"""Preprocessing and shards: accounting, determinism, stable splits, checksums, atomic output, dataset."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tasks import preprocess
from tasks.core.io import read_json
from tasks.core.params import AugmentParams, PreprocessParams
from tasks.images.imaging import decode_image, resize_crop
from tasks.images.shards import ShardError, ShardSplit
from tasks.images.validation import SOURCE, discover
from tasks.training.augment import Augment
from tasks.training.dataset import ShardDataset
from tests.helpers.folders import make_imagefolder
from tests.helpers.project import ROOT

pytestmark = pytest.mark.fast  # unit-level: make test-fast

PARAMS = PreprocessParams(image_size=16, workers=1, shard_size=16, val_fraction=0.2, test_fraction=0.2)


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_accounting_and_quarantine(imagefolder: Path, tmp_path: Path) -> None:
    (imagefolder / "class_0" / "notes.md").write_text("not an image")
    (imagefolder / "class_0" / ".hidden.png").write_bytes(b"x")
    (imagefolder / "class_1" / "empty.jpg").write_bytes(b"")
    (imagefolder / "class_1" / "text.png").write_text("hello")
    good = (imagefolder / "class_2" / "000.jpg").read_bytes()
    (imagefolder / "class_2" / "cut.jpg").write_bytes(good[: len(good) // 2])
    before = tree_bytes(imagefolder)

    result = preprocess.run(PARAMS, seed=1, source=imagefolder, out_dir=tmp_path / "shards")

    report = read_json(tmp_path / "shards" / "quarantine.json")
    counts = report["counts"]
    assert counts == result.counts
    assert counts["seen"] == counts["accepted"] + counts["quarantined"] + counts["ignored"] == 65
    reasons = {q["path"]: q["reason"] for q in report["quarantined"]}
    assert reasons["class_1/empty.jpg"] == "empty_file"
    assert reasons["class_1/text.png"] == "not_an_image"
    assert reasons["class_2/cut.jpg"] == "truncated"
    assert {i["path"] for i in report["ignored"]} == {"class_0/notes.md", "class_0/.hidden.png"}
    assert sum(result.split_counts.values()) == counts["accepted"] == 60
    assert tree_bytes(imagefolder) == before  # raw data never modified


def test_same_input_gives_identical_bytes(imagefolder: Path, tmp_path: Path) -> None:
    preprocess.run(PARAMS, seed=1, source=imagefolder, out_dir=tmp_path / "a")
    preprocess.run(PARAMS.model_copy(update={"workers": 2}), seed=1, source=imagefolder, out_dir=tmp_path / "b")
    assert tree_bytes(tmp_path / "a") == tree_bytes(tmp_path / "b")
    assert str(tmp_path) not in (tmp_path / "a" / "manifest.json").read_text()


def test_adding_images_never_moves_existing_ones(imagefolder: Path, tmp_path: Path) -> None:
    preprocess.run(PARAMS, seed=1, source=imagefolder, out_dir=tmp_path / "before")
    make_imagefolder(tmp_path / "extra", per_class=10, seed=99)
    for path in (tmp_path / "extra").rglob("*.*"):
        shutil.copy(path, imagefolder / path.parent.name / f"new_{path.name}")
    preprocess.run(PARAMS, seed=1, source=imagefolder, out_dir=tmp_path / "after")
    before = {f["path"]: f["split"] for f in read_json(tmp_path / "before" / "manifest.json")["files"]}
    after = {f["path"]: f["split"] for f in read_json(tmp_path / "after" / "manifest.json")["files"]}
    assert len(after) == len(before) + 30
    assert all(after[path] == split for path, split in before.items())
    assert set(before.values()) == {"train", "val", "test"}


def test_altered_shard_is_refused(imagefolder: Path, tmp_path: Path) -> None:
    out = tmp_path / "shards"
    preprocess.run(PARAMS, seed=1, source=imagefolder, out_dir=out)
    shard = sorted(out.glob("train-*.arrow"))[0]
    data = bytearray(shard.read_bytes())
    data[-200] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=f"{shard.name}: checksum does not match"):
        ShardSplit.open(out, "train")


def test_crash_leaves_no_output(imagefolder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tasks.images.shards import ShardFile

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("disk full")

    # Fail while shards are being written (a full disk), after some files already exist.
    monkeypatch.setattr(ShardFile, "close", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        preprocess.run(PARAMS, seed=1, source=imagefolder, out_dir=tmp_path / "shards")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert "shards" not in left  # nothing that looks complete: only the hidden folder a rerun takes from
    assert all(name == imagefolder.name or name.startswith(".shards.tmp-") for name in left), left
    assert not any((tmp_path / name / "manifest.json").exists() for name in left)


def test_missing_or_flat_source_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(preprocess.StageError, match="nope: no such folder"):
        preprocess.run(PARAMS, seed=1, source=tmp_path / "nope", out_dir=tmp_path / "out")
    (tmp_path / "flat").mkdir()
    with pytest.raises(preprocess.StageError, match=r"found 0 class folder\(s\), need at least 2"):
        preprocess.run(PARAMS, seed=1, source=tmp_path / "flat", out_dir=tmp_path / "out")


def test_typed_folders_are_checked_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The generate stage runs first and checks data.source and data.test_source: DVC would fail only at
    preprocess, with a bare `[Errno 2]`, and would read `~` literally."""
    from tasks.core.params import DataParams
    from tasks.images.layout import check_data_folders

    monkeypatch.chdir(tmp_path)
    generated = Path("data/generated")
    check_data_folders(DataParams(), generated)  # the default: generate makes it
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "a.jpg").write_bytes(b"x")
    (tmp_path / "file.txt").write_text("x")
    images = make_imagefolder(tmp_path / "images", classes=2, per_class=1)
    cases = {
        "~/my_images": r"data.source ~/my_images: '~' is not expanded by DVC; write the full path: /",
        "nope": rf"data.source nope: no such folder \(relative to {tmp_path}\)",
        str(tmp_path / "file.txt"): r"file.txt: a file, not a folder",
        str(flat): r"flat: found 0 class folder\(s\), need at least 2 .*its 1 image file\(s\) outside any class",
    }
    for source, expected in cases.items():
        with pytest.raises(preprocess.StageError, match=expected):
            check_data_folders(DataParams(source=Path(source)), generated)
    check_data_folders(DataParams(source=images), generated)
    with pytest.raises(preprocess.StageError, match=r"data.test_source missing_test: no such folder"):
        check_data_folders(DataParams(source=images, test_source=Path("missing_test")), generated)


def test_the_log_names_quarantined_files(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    source = make_imagefolder(tmp_path / "src", classes=2, per_class=10)
    for i in range(5):
        (source / "class_0" / f"empty{i}.jpg").write_bytes(b"")
    (source / "class_1" / "notes.txt").write_text("x")
    with caplog.at_level("INFO", logger="tasks"):
        preprocess.run(PARAMS, seed=1, source=source, out_dir=tmp_path / "shards")
    log = caplog.text
    assert ("quarantined 5 file(s): empty_file: class_0/empty0.jpg (zero bytes), class_0/empty1.jpg (zero bytes), "
            "class_0/empty2.jpg (zero bytes), and 2 more") in log  # fmt: skip
    assert "ignored 1 file(s): not_image_name: class_1/notes.txt" in log
    assert f"every quarantined and ignored file, with its reason: {tmp_path / 'shards' / 'quarantine.json'}" in log


def test_discovery_follows_links_once_and_ignores_what_is_not_a_file(tmp_path: Path) -> None:
    root = tmp_path / "images"
    make_imagefolder(root, classes=2, per_class=3)
    (root / "class_0" / "nested").mkdir()
    shutil.copy(root / "class_0" / sorted(os.listdir(root / "class_0"))[0], root / "class_0" / "nested" / "deep.png")
    (root / "class_1" / "alias").symlink_to(root / "class_0" / "nested", target_is_directory=True)  # seen twice
    (root / "class_0" / "nested" / "loop").symlink_to(root / "class_0", target_is_directory=True)  # a cycle
    (root / "class_1" / "gone.jpg").symlink_to(root / "missing.jpg")  # broken link with an image name
    os.mkfifo(root / "class_1" / "pipe.png")  # would block a reader forever
    found, sizes, ignored = discover(root, role=SOURCE, class_names=("class_0", "class_1"))
    paths = [c.path for c in found]
    assert paths == sorted(paths) and len(paths) == len(set(paths))
    assert "class_0/nested/deep.png" in paths and not any("alias" in p or "loop" in p for p in paths)
    assert {i["path"]: i["reason"] for i in ignored} == {
        "class_1/gone.jpg": "not_a_file",
        "class_1/pipe.png": "not_a_file",
    }
    assert [h.size for h in sizes] == [(root / p).stat().st_size for p in paths]
    result = preprocess.run(PARAMS, seed=1, source=root, out_dir=tmp_path / "out")  # the fifo is never opened
    assert result.counts["ignored"] == 2 and result.counts["seen"] == len(paths) + 2


def test_preprocess_stage_does_not_import_torch() -> None:
    """Shards are written with numpy and pyarrow alone: torch costs the stage a second of start-up
    and makes the parent that the decoders fork from much bigger."""
    code = "import sys, tasks.preprocess; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout


def test_dataset_reads_shards_and_augments_reproducibly(imagefolder: Path, tmp_path: Path) -> None:
    out = tmp_path / "shards"
    preprocess.run(PARAMS, seed=1, source=imagefolder, out_dir=out)
    plain = ShardDataset(out, "train")
    image, label = plain[3]
    assert image.dtype == torch.uint8 and image.shape == (3, 16, 16)
    assert 0 <= label < 3
    assert len(plain) == read_json(out / "manifest.json")["splits"]["train"]["count"]

    augmented = ShardDataset(out, "train", augment=Augment(AugmentParams(crop_padding=4, hflip=True)), seed=5)

    def batches(workers: int) -> list[torch.Tensor]:
        loader = torch.utils.data.DataLoader(augmented, batch_size=8, num_workers=workers)
        return [images for images, _ in loader]

    zero, two = batches(0), batches(2)
    assert all(torch.equal(a, b) for a, b in zip(zero, two, strict=True))
    augmented.set_epoch(1)
    assert not all(torch.equal(a, b) for a, b in zip(zero, batches(0), strict=True))


def test_decode_normalises_modes(tmp_path: Path) -> None:
    sixteen = np.full((8, 8), 40000, dtype=np.uint16)
    Image.fromarray(sixteen).save(tmp_path / "16.png")
    assert np.asarray(decode_image((tmp_path / "16.png").read_bytes()))[0, 0].tolist() == [156] * 3
    rgba = Image.new("RGBA", (8, 8), (255, 0, 0, 0))
    rgba.save(tmp_path / "a.png")
    assert np.asarray(decode_image((tmp_path / "a.png").read_bytes()))[0, 0].tolist() == [255, 255, 255]
    wide = Image.new("RGB", (40, 20), (0, 0, 0))
    wide.paste((255, 255, 255), (0, 0, 6, 20))  # a white strip on the left: cut by the center crop
    arr = resize_crop(wide, 10)
    assert arr.shape == (3, 10, 10) and arr.max() == 0
