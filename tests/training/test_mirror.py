"""`train.augment.hflip: auto`: drawn digits get no flips, mirror-symmetric shapes keep them, decided from the
training images before step 1 and recorded with the measurement."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tasks import preprocess
from tasks.core.params import PreprocessParams, TrainParams
from tasks.training.mirror import MAX_LOSS, mirror_check
from tasks.training.start import training_start
from tests.helpers.folders import draw_glyph_folder, draw_shapes_folder

pytestmark = pytest.mark.fast

PRE = PreprocessParams(image_size=32, workers=2)


def shards_of(folder: Path, out: Path) -> Path:
    preprocess.run(PRE, seed=3, source=folder, out_dir=out)
    return out


@pytest.fixture(scope="module")
def glyph_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("glyphs")
    return shards_of(draw_glyph_folder(tmp / "glyphs", per_class=40, seed=4), tmp / "shards")


@pytest.fixture(scope="module")
def shape_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("shapes")
    return shards_of(draw_shapes_folder(tmp / "shapes", classes=6, per_class=60, seed=4), tmp / "shards")


def test_digits_get_no_flips_and_the_run_records_why(glyph_shards: Path) -> None:
    start = training_start(TrainParams(), seed=1, shard_dir=glyph_shards, pretrained_dir=glyph_shards / "none")
    assert start.params.augment.hflip is False
    assert start.dataset.augment.params.hflip is False  # what the loader applies, not only what is logged
    check = start.recipe.to_json()["mirror_check"]
    assert check["hflip"] is False and check["loss"] > MAX_LOSS
    assert check["accuracy"] - check["mirrored_accuracy"] > 0.2
    reason = next(r for r in start.recipe.reasons() if r.startswith("augment.hflip"))
    assert reason.startswith("augment.hflip off (auto: a linear classifier") and "no flips" in reason


def test_mirror_symmetric_shapes_keep_flips(shape_shards: Path) -> None:
    start = training_start(TrainParams(), seed=1, shard_dir=shape_shards, pretrained_dir=shape_shards / "none")
    assert start.params.augment.hflip is True and start.dataset.augment.params.hflip is True
    assert start.recipe.to_json()["mirror_check"]["loss"] <= MAX_LOSS


def test_true_and_false_force_it_without_a_check(glyph_shards: Path) -> None:
    for forced in (True, False):
        train = TrainParams().model_copy(update={"augment": TrainParams().augment.model_copy(update={"hflip": forced})})
        start = training_start(train, seed=1, shard_dir=glyph_shards, pretrained_dir=glyph_shards / "none")
        assert start.params.augment.hflip is forced and start.recipe.mirror is None


def test_the_check_is_the_same_for_the_same_seed_and_says_when_it_cannot_tell() -> None:
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, size=(200, 3, 32, 32), dtype=np.uint8)  # labels unrelated to the pixels
    labels = rng.integers(0, 4, size=200)
    first, second = mirror_check(noise, labels, 4, seed=5), mirror_check(noise, labels, 4, seed=5)
    assert (first.accuracy, first.mirrored) == (second.accuracy, second.mirrored)
    assert first.hflip is True and "too close to chance" in first.why()


def test_an_unresolved_auto_never_reaches_the_loader() -> None:
    from tasks.core.params import AugmentParams
    from tasks.training.augment import Augment

    with pytest.raises(ValueError, match="augment.hflip 'auto': resolve it first"):
        Augment(AugmentParams())
