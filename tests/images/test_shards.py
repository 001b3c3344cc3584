"""Shard reader and dataset: zero-copy memory maps, integrity checks, and augmentation that is the
same for any batch, worker count or sampler (DistributedSampler included)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as TF
from torch.utils.data import DataLoader, DistributedSampler

from tasks import preprocess
from tasks.core.errors import StageError
from tasks.core.io import read_json
from tasks.core.params import AugmentParams, ParamsError, PreprocessParams, parse_params
from tasks.images.shards import ShardError, ShardFile, ShardSplit
from tasks.training.augment import Augment, uniforms
from tasks.training.dataset import ShardDataset
from tests.helpers.folders import make_imagefolder

pytestmark = pytest.mark.fast  # unit-level: make test-fast

PARAMS = PreprocessParams(image_size=16, workers=1, shard_size=7, val_fraction=0.2, test_fraction=0.2)
MODES = [
    AugmentParams(hflip=True),
    AugmentParams(hflip=True, crop="random_resized", scale=(0.3, 1.0)),
    AugmentParams(crop="none", hflip=True),
    AugmentParams(crop="pad", crop_padding=7, hflip=False),
    AugmentParams(
        hflip=True, crop="random_resized", color_jitter={"brightness": 0.4, "contrast": 0.4, "saturation": 0.4}
    ),
]
JITTER = {"brightness": 0.5, "contrast": 0.3, "saturation": 0.8}


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shards")
    make_imagefolder(root / "images", classes=3, per_class=20)
    preprocess.run(PARAMS, seed=1, source=root / "images", out_dir=root / "shards")
    return root / "shards"


def test_reads_are_zero_copy_views_of_the_memory_map(shards: Path) -> None:
    split = ShardSplit.open(shards, "train")
    assert len(split.images) > 1  # several shard files: reads cross file boundaries
    view = split.image(0)
    assert not view.flags.owndata and not view.flags.writeable  # a view into the read-only map
    everything = split.all_images()
    indices = [len(split) - 1, 0, 8, 7, 6, 3]
    assert np.array_equal(split.take(indices), everything[indices])
    assert split.take(indices).flags.writeable
    with pytest.raises(IndexError):
        split.image(len(split))


def test_dataset_batches_equal_single_samples_for_any_workers(shards: Path) -> None:
    for params in MODES:
        data = ShardDataset(shards, "train", augment=Augment(params), seed=5)
        data.set_epoch(3)
        one_by_one = torch.stack([data[i][0] for i in range(len(data))])

        def loaded(workers: int, batch_size: int, data: ShardDataset = data) -> torch.Tensor:
            loader = DataLoader(data, batch_size=batch_size, num_workers=workers)
            return torch.cat([images for images, _ in loader])

        assert torch.equal(loaded(0, 8), one_by_one), params
        assert torch.equal(loaded(2, 5), one_by_one), params
        data.set_epoch(4)
        assert not torch.equal(loaded(0, 8), one_by_one), f"epoch does not change the augmentation: {params}"


def test_distributed_sampler_ranks_see_the_same_samples(shards: Path) -> None:
    data = ShardDataset(shards, "train", augment=Augment(AugmentParams(hflip=True, crop="random_resized")), seed=9)
    reference = {i: data[i][0] for i in range(len(data))}
    seen = []
    for rank in range(2):
        sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=0)
        sampler.set_epoch(1)
        order = list(sampler)
        loader = DataLoader(data, batch_size=4, sampler=sampler, num_workers=1)
        images = torch.cat([batch for batch, _ in loader])
        assert all(torch.equal(images[k], reference[i]) for k, i in enumerate(order))
        seen += order
    assert set(seen) == set(range(len(data)))


def test_colour_jitter_is_torchvisions_and_leaves_crops_and_flips_alone() -> None:
    rng = np.random.default_rng(3)
    images = torch.from_numpy(rng.integers(0, 256, (24, 3, 12, 12), dtype=np.uint8))
    keys = [(7, 2, i) for i in range(24)]
    plain = Augment(AugmentParams(hflip=True, crop="pad", crop_padding=3)).batch(images, keys)
    jittered = Augment(AugmentParams(hflip=True, crop="pad", crop_padding=3, color_jitter=JITTER)).batch(images, keys)
    assert (jittered != plain).float().mean() > 0.5  # it does something, to nearly every pixel
    factors = uniforms([(*key, 0xC0102) for key in keys], 3)
    spans = np.array([JITTER["brightness"], JITTER["contrast"], JITTER["saturation"]])
    low = np.maximum(0, 1 - spans)
    for k in range(24):
        bright, contrast, saturation = (low + factors[k] * (1 + spans - low)).tolist()
        for value, span in zip((bright, contrast, saturation), spans.tolist(), strict=True):
            assert 1 - span <= value <= 1 + span
        # torchvision's ColorJitter ops in the same order, on the crop and flip made without jitter
        x = plain[k].float() / 255
        x = TF.adjust_saturation(TF.adjust_contrast(TF.adjust_brightness(x, bright), contrast), saturation)
        assert (jittered[k].float() - x * 255).abs().max() <= 1.0, k
    alone = Augment(AugmentParams(hflip=True, crop="pad", crop_padding=3, color_jitter=JITTER))
    assert all(torch.equal(alone(images[k], keys[k]), jittered[k]) for k in (0, 5, 23))  # not batch-dependent
    assert jittered.dtype == torch.uint8


def test_augmentations_do_what_they_say() -> None:
    image = torch.arange(3 * 16 * 16, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(1, 3, 16, 16)
    keys = [(1, 0, i) for i in range(64)]
    batch = image.expand(64, -1, -1, -1)
    flips = uniforms(keys, 1)[:, 0] < 0.5
    flipped = Augment(AugmentParams(hflip=True, crop="none")).batch(batch, keys)
    for k in range(64):
        assert torch.equal(flipped[k], image[0].flip(-1) if flips[k] else image[0])
    assert 20 < flips.sum() < 44
    padded = Augment(AugmentParams(crop_padding=4, hflip=False)).batch(batch, keys)
    reflect = torch.nn.functional.pad(image.float(), (4, 4, 4, 4), mode="reflect")[0].to(torch.uint8)
    for k in range(64):  # every output is some 16x16 window of the reflect-padded image
        assert any(
            torch.equal(padded[k], reflect[:, t : t + 16, left : left + 16]) for t in range(9) for left in range(9)
        )
    resized = Augment(AugmentParams(crop="random_resized", scale=(1.0, 1.0), ratio=(1.0, 1.0), hflip=False))
    assert torch.equal(resized.batch(batch, keys), batch)  # the whole image, resized to itself
    strong = Augment(AugmentParams(hflip=True, crop="random_resized", scale=(0.1, 0.2)))
    assert not torch.equal(strong.batch(batch, keys)[0], image[0])


def test_augment_params_are_validated() -> None:
    with pytest.raises(ParamsError, match=r"train\.augment: .*scale must satisfy"):
        parse_params({"train": {"augment": {"scale": [0.5, 0.2]}}}, "p.yaml")
    with pytest.raises(ParamsError, match=r"train\.augment\.crop"):
        parse_params({"train": {"augment": {"crop": "rotate"}}}, "p.yaml")
    with pytest.raises(ValueError, match="non-negative ints"):
        uniforms([(-1, 0, 0)], 2)


def test_integrity_errors_name_the_file(shards: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    entry = read_json(shards / "manifest.json")["splits"]["val"]["shards"][0]
    shutil.copytree(shards, broken)
    (broken / entry["file"]).unlink()
    with pytest.raises(ShardError, match=f"{entry['file']}: shard listed in the manifest is missing"):
        ShardSplit.open(broken, "val")
    manifest = read_json(shards / "manifest.json")
    manifest["format_version"] = 1
    (broken / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match="format_version 1, expected 3; rerun the preprocess stage"):
        ShardSplit.open(broken, "train")
    with pytest.raises(ShardError, match="no shard manifest"):
        ShardSplit.open(tmp_path / "nothing", "train")


def test_truncated_shard_is_refused_even_unverified(shards: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(shards, copy)
    name = read_json(copy / "manifest.json")["splits"]["train"]["shards"][0]["file"]
    data = (copy / name).read_bytes()
    (copy / name).write_bytes(data[: len(data) // 2])
    with pytest.raises(ShardError, match=f"{name}: checksum does not match"):
        ShardSplit.open(copy, "train")
    with pytest.raises(ShardError, match=f"{name}: not a readable Arrow IPC file"):
        ShardSplit.open(copy, "train", verify=False)


def test_writer_output_depends_only_on_the_images(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (23, 3, 8, 8), dtype=np.uint8)
    entries = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        writer = ShardFile(tmp_path / name / "train.arrow", image_size=8)
        writer.batch_rows = 10  # several record batches in one file
        for k, image in enumerate(images):
            writer.add(image, k % 3)
        entries.append(writer.close())
    assert entries[0] == entries[1] and entries[0]["count"] == 23
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["train.arrow"]  # no partial file left


def test_a_model_of_other_classes_is_refused_as_a_stage_error(shards: Path) -> None:
    split = ShardSplit.open(shards, "test")
    split.require_classes(split.class_names, "models/model.pt")  # the same names, in order: accepted
    wrong = tuple(reversed(split.class_names))
    with pytest.raises(ShardError, match=rf"models/model.pt: classes .* differ from {shards}'s") as caught:
        split.require_classes(wrong, "models/model.pt")
    assert isinstance(caught.value, StageError)  # stage_main prints it in one line and exits 2
