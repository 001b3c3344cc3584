"""`train.augment.hflip: auto`: letters whose mirror images are other letters get no flips; mirror-symmetric shapes
and objects that all face one way keep them; decided from the training images before step 1 and recorded with the
measurement."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tasks import preprocess
from tasks.core.params import PreprocessParams, TrainParams
from tasks.training.mirror import MAX_LOSS, mirror_check
from tasks.training.start import training_start
from tests.helpers.folders import draw_facing_folder, draw_glyph_folder, draw_shapes_folder

pytestmark = pytest.mark.fast

PRE = PreprocessParams(image_size=32, workers=2)


def shards_of(folder: Path, out: Path) -> Path:
    preprocess.run(PRE, seed=3, source=folder, out_dir=out)
    return out


@pytest.fixture(scope="module")
def glyph_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("glyphs")
    return shards_of(draw_glyph_folder(tmp / "glyphs", per_class=40, seed=4, glyphs="bdpqaehk"), tmp / "shards")


@pytest.fixture(scope="module")
def shape_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("shapes")
    return shards_of(draw_shapes_folder(tmp / "shapes", classes=6, per_class=60, seed=4), tmp / "shards")


def test_letters_whose_mirrors_are_other_letters_get_no_flips_and_the_run_records_why(glyph_shards: Path) -> None:
    start = training_start(TrainParams(), seed=1, shard_dir=glyph_shards, pretrained_dir=glyph_shards / "none")
    assert start.params.augment.hflip is False
    assert start.dataset.augment.params.hflip is False  # what the loader applies, not only what is logged
    check = start.recipe.to_json()["mirror_check"]
    assert check["hflip"] is False and check["loss"] > MAX_LOSS
    assert check["accuracy"] - check["with_mirrors_accuracy"] > 0.1
    assert check["worst_class"]["name"] in {"glyph_b", "glyph_d", "glyph_p", "glyph_q"}
    reason = next(r for r in start.recipe.reasons() if r.startswith("augment.hflip"))
    assert reason.startswith("augment.hflip off (auto: a nearest-neighbour classifier") and "no flips" in reason


def test_mirror_symmetric_shapes_keep_flips(shape_shards: Path) -> None:
    start = training_start(TrainParams(), seed=1, shard_dir=shape_shards, pretrained_dir=shape_shards / "none")
    assert start.params.augment.hflip is True and start.dataset.augment.params.hflip is True
    assert start.recipe.to_json()["mirror_check"]["loss"] <= MAX_LOSS


def test_digits_get_no_flips_because_mirrors_of_one_digit_take_another_digits_place(tmp_path: Path) -> None:
    """Overall, adding the mirrors costs digits little (a mirrored 7 is no digit); but mirrored 3s land among the
    8s, which a one-sided exact test on the 8s' (or 3s') held-out images finds."""
    shards = shards_of(draw_glyph_folder(tmp_path / "digits", per_class=80, seed=4), tmp_path / "shards")
    start = training_start(TrainParams(), seed=1, shard_dir=shards, pretrained_dir=shards / "none")
    check = start.recipe.to_json()["mirror_check"]
    assert check["loss"] <= MAX_LOSS  # the folder as a whole barely notices
    assert check["worst_class"]["p"] < 0.05 / 10 and check["worst_class"]["lost"] > check["worst_class"]["gained"]
    assert start.params.augment.hflip is False


@pytest.mark.slow  # 158 s (the probe trains twice); flips kept by the probe: tests/training/test_flip_probe.py
def test_objects_that_all_face_one_way_keep_flips(tmp_path: Path) -> None:
    """A mirrored car is unlike every training car (the held-out mirrors score far below the originals), yet it is
    no other class: adding mirrors costs nothing, so flips stay on."""
    shards = shards_of(draw_facing_folder(tmp_path / "facing", per_class=50, seed=4), tmp_path / "shards")
    start = training_start(TrainParams(), seed=1, shard_dir=shards, pretrained_dir=shards / "none")
    check = start.recipe.to_json()["mirror_check"]
    assert check["accuracy"] - check["mirrored_accuracy"] > 0.3  # one-way: a mirror looks unlike its class
    assert check["loss"] <= MAX_LOSS and check["worst_class"]["p"] >= 0.05 / 5
    assert start.params.augment.hflip is True


def test_true_and_false_force_it_without_a_check(glyph_shards: Path) -> None:
    for forced in (True, False):
        train = TrainParams().model_copy(update={"augment": TrainParams().augment.model_copy(update={"hflip": forced})})
        start = training_start(train, seed=1, shard_dir=glyph_shards, pretrained_dir=glyph_shards / "none")
        assert start.params.augment.hflip is forced and start.recipe.mirror is None


def test_the_check_is_the_same_for_the_same_seed_and_says_when_it_cannot_tell() -> None:
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, size=(200, 3, 32, 32), dtype=np.uint8)  # labels unrelated to the pixels
    labels = rng.integers(0, 4, size=200)
    names = ("a", "b", "c", "d")
    first, second = mirror_check(noise, labels, names, seed=5), mirror_check(noise, labels, names, seed=5)
    assert (first.accuracy, first.with_mirrors) == (second.accuracy, second.with_mirrors)
    assert first.hflip is True and "too close to chance" in first.why()


def test_an_unresolved_auto_never_reaches_the_loader() -> None:
    from tasks.core.params import AugmentParams
    from tasks.training.augment import Augment

    with pytest.raises(ValueError, match="augment.hflip 'auto': resolve it first"):
        Augment(AugmentParams())
