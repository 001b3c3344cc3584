"""A pass over a whole split holds a block of it, not the split (issue 57: all_images() of 100,000 images of
224 px is 15 GB): blocks cut in row order across memory maps, predictors fed block by block give the bits of the
whole array, and evaluate's label-error pass, score_images and training's validation allocate a few blocks.

Memory is what tracemalloc sees: numpy registers every array it allocates (the pixels copied out of the maps, the
float batches), not torch's or onnxruntime's own buffers, nor the mapped shard files (page cache, not the heap).
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tasks import evaluate
from tasks.core import blocks
from tasks.core.blocks import batches, block_rows
from tasks.core.io import read_json
from tasks.core.params import EvaluateParams
from tasks.images.shards import ShardSplit
from tasks.release.inference import OnnxModel
from tasks.release.scoring import score_images, score_promoted_set, split_images
from tasks.training.distributed import World
from tasks.training.loop import validate
from tasks.training.models import predict_logits, split_logits
from tests.helpers.shard_dirs import spec_of, tiny_net, tiny_onnx, write_dynamics, write_shard_dir

pytestmark = pytest.mark.fast  # unit-level: make test-fast

SMALL = {"train": 30, "val": 11, "test": 17}
LARGE = {"train": 300, "val": 120, "test": 600}  # 128 px: 48 KiB an image, train 15 MB, test 29 MB
BUDGET = 1 << 20  # BLOCK_BYTES in the memory tests: 786 KB blocks (16 images of 128 px, 256 of 32 px)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("small") / "shards"
    write_shard_dir(out, SMALL, image_size=12, classes=3, shard_rows=7)  # several maps per split
    return out


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("large") / "shards"
    spec = write_shard_dir(out, LARGE, image_size=128, classes=4, shard_rows=250)
    write_dynamics(out.parent / "train_dynamics.json", LARGE["train"])
    tiny_onnx(out.parent / "model.onnx", spec)
    return out


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A val split of many small images: validation's batches are 256, so a block is at least 256 images."""
    out = tmp_path_factory.mktemp("many") / "shards"
    write_shard_dir(out, {"val": 6000}, image_size=32, classes=4, shard_rows=1000)  # 18 MB
    return out


def test_blocks_cut_the_split_in_row_order_across_maps(small: Path) -> None:
    split = ShardSplit.open(small, "train")
    everything = split.all_images()
    assert len(split.images) > 3
    for rows in (1, 4, 7, 8, 30, 100):
        cut = list(split.blocks(rows))
        assert [len(b) for b in cut] == [min(rows, len(split) - start) for start in range(0, len(split), rows)]
        assert all(b.flags.writeable and b.flags.c_contiguous and b.dtype == np.uint8 for b in cut)
        np.testing.assert_array_equal(np.concatenate(cut), everything)
    picked = np.array([29, 0, 7, 6, 13, 13, 2])
    np.testing.assert_array_equal(np.concatenate(list(split.blocks(3, picked))), everything[picked])
    np.testing.assert_array_equal(split.span(5, 16), everything[5:16])
    assert list(split.blocks(4, [])) == [] and len(split.span(9, 9)) == 0
    with pytest.raises(ValueError):
        split.blocks(0)
    with pytest.raises(IndexError):
        split.blocks(4, [len(split)])
    with pytest.raises(IndexError):
        split.span(0, len(split) + 1)


def test_batches_are_the_rows_of_the_array_cut_at_the_same_places() -> None:
    images = np.arange(23 * 2).reshape(23, 2)
    expected = [images[s : s + 5] for s in range(0, 23, 5)]
    for cuts in ([23], [1] * 23, [4, 1, 9, 2, 7], [5, 5, 5, 5, 3], [0, 11, 0, 12]):
        edges = np.cumsum([0, *cuts])
        got = list(batches((images[a:b].copy() for a, b in zip(edges[:-1], edges[1:], strict=True)), 5))
        assert [b.tolist() for b in got] == [b.tolist() for b in expected], cuts
    assert [b.tolist() for b in batches(images, 5)] == [b.tolist() for b in expected]
    assert list(batches(iter([]), 5)) == []
    assert block_rows(224, 256) == 256 and block_rows(16, 32, budget=32 * 768 * 3) == 96


def test_streamed_logits_are_the_bits_of_the_whole_split(small: Path, tmp_path: Path) -> None:
    """Old path: one array from all_images(); new path: blocks whose edges fall anywhere, and rows by index."""
    split = ShardSplit.open(small, "train")
    spec = spec_of(small)
    model = tiny_net(len(spec.class_names))
    whole = predict_logits(model, split.all_images(), spec, 4)
    for streamed in (split_logits(model, split, spec, 4), predict_logits(model, split.blocks(7), spec, 4)):
        assert streamed.dtype == whole.dtype and np.array_equal(streamed, whole)
    picked = np.array([3, 29, 1, 1, 20])
    old = predict_logits(model, split.all_images()[picked], spec, 4)
    assert np.array_equal(split_logits(model, split, spec, 4, indices=picked), old)
    onnx = OnnxModel.load(tiny_onnx(tmp_path / "model.onnx", spec))
    assert np.array_equal(onnx.logits(split.blocks(5), 3), onnx.logits(split.all_images(), 3))
    test = ShardSplit.open(small, "test")
    assert np.array_equal(np.asarray(score_images(onnx, small, "test", 4).predicted),
                          onnx.logits(test.all_images(), 4).argmax(axis=1))  # fmt: skip
    promoted = set(split_images(small, "test")[::3])
    rows = [i for i, digest in enumerate(split_images(small, "test")) if digest in promoted]
    expected = onnx.logits(test.all_images()[rows], 4).argmax(axis=1) == test.labels[rows]
    assert score_promoted_set(onnx, small, promoted, 4)["accuracy"] == pytest.approx(float(expected.mean()))


def peak_bytes(work: Callable[[], Any]) -> tuple[int, Any]:
    """The most memory tracemalloc saw allocated at once while `work` ran, above what was held before it; its result."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        result = work()
        return tracemalloc.get_traced_memory()[1] - before, result
    finally:
        tracemalloc.stop()


def split_bytes(shards: Path, split: str) -> int:
    data = ShardSplit.open(shards, split, verify=False)
    return len(data) * data.images[0][0].nbytes


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(blocks, "BLOCK_BYTES", BUDGET)
    yield


def test_the_label_error_pass_holds_a_few_blocks_not_the_splits(large: Path, small_blocks: None) -> None:
    spec, dynamics = spec_of(large), large.parent / "train_dynamics.json"
    params = EvaluateParams(batch_size=8, label_errors=10)
    model = tiny_net(len(spec.class_names))
    out = large.parent / "label_errors.json"
    peak, _ = peak_bytes(lambda: evaluate._label_errors(model, spec, large, {}, params, None, dynamics, out, 1.0))
    largest = max(split_bytes(large, split) for split in LARGE)
    # Held at once: a block or two, a batch as float32 (a block's size), the manifest's list of files (about 1 MB)
    assert peak < largest / 4, f"{peak / 1e6:.1f} MB at once; the largest split is {largest / 1e6:.1f} MB"
    assert len(read_json(out)["likely_label_errors"]) == 10


def test_scoring_and_validation_hold_a_few_blocks_not_the_split(large: Path, many: Path, small_blocks: None) -> None:
    onnx = OnnxModel.load(large.parent / "model.onnx")
    promoted = set(split_images(large, "test")[1:])  # the nightly's fixed test set: all test images but one
    val, spec = ShardSplit.open(many, "val"), spec_of(many)
    for name, whole, scored, work in (
        ("score_images", split_bytes(large, "test"), 600, lambda: score_images(onnx, large, "test", 8).metrics),
        ("score_promoted_set", split_bytes(large, "test"), 599, lambda: score_promoted_set(onnx, large, promoted, 8)),
        ("validate", split_bytes(many, "val"), 6000, lambda: validate(tiny_net(4), val, val.labels, spec, World())),
    ):
        peak, metrics = peak_bytes(work)
        assert peak < whole / 4, f"{name}: {peak / 1e6:.1f} MB at once for a split of {whole / 1e6:.1f} MB"
        assert metrics["num_samples"] == scored
