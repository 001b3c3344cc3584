"""preprocess.resize: fastai's crop, squash and pad, the aspect-ratio summary, and what `auto` picks from it."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from tasks import preprocess
from tasks.core.io import read_json
from tasks.core.params import PreprocessParams
from tasks.images.aspect import Aspect, choose_resize
from tasks.images.imaging import LEGACY_CROP, PreprocessSpec, to_square
from tests.helpers.folders import draw_offcentre_folder, make_imagefolder

pytestmark = pytest.mark.fast  # unit-level: make test-fast


def stripes(width: int, height: int) -> Image.Image:
    """Left third red, middle green, right third blue: what each mode keeps is visible in the columns."""
    arr = np.zeros((height, width, 3), np.uint8)
    third = width // 3
    arr[:, :third, 0] = arr[:, third : 2 * third, 1] = arr[:, 2 * third :, 2] = 255
    return Image.fromarray(arr)


def test_crop_cuts_the_sides_off_a_wide_image() -> None:
    out = to_square(stripes(300, 100), 30, "crop", "nearest")
    assert out.shape == (3, 30, 30)
    assert out[1, 15, :].min() == 255 and out[0].max() == 0 and out[2].max() == 0  # only the green middle is left


def test_squash_keeps_all_of_it_distorted() -> None:
    out = to_square(stripes(300, 100), 30, "squash", "nearest")
    assert out.shape == (3, 30, 30)
    assert out[0, 15, 2] == 255 and out[1, 15, 15] == 255 and out[2, 15, 27] == 255  # all three thirds, each 10 px


def test_pad_keeps_the_aspect_with_black_bars() -> None:
    out = to_square(stripes(300, 100), 30, "pad", "nearest")
    assert out.shape == (3, 30, 30)
    assert out[:, :10].max() == 0 and out[:, 20:].max() == 0  # 300x100 -> 30x10, centred: black above and below
    assert out[0, 15, 2] == 255 and out[2, 15, 27] == 255
    tall = to_square(stripes(300, 100).transpose(Image.Transpose.ROTATE_90), 30, "pad", "nearest")  # 100 x 300
    assert tall[:, :, :10].max() == 0 and tall[:, :, 20:].max() == 0


def test_an_unknown_mode_is_refused_and_old_model_files_mean_crop() -> None:
    with pytest.raises(ValueError, match="'stretch' is not one of"):
        to_square(stripes(30, 30), 10, "stretch")
    spec = PreprocessSpec(image_size=8, resize=LEGACY_CROP, mean=(0, 0, 0), std=(1, 1, 1), class_names=("a",))
    assert spec.resize == "crop"
    with pytest.raises(ValueError, match="resize 'stretch' is not one of"):
        PreprocessSpec(image_size=8, resize="stretch", mean=(0, 0, 0), std=(1, 1, 1), class_names=("a",))


def test_aspect_summary_and_auto() -> None:
    square = Aspect.of([(64, 64)] * 95 + [(100, 64)] * 5)
    assert (square.count, square.wide, square.tall, square.near_square) == (100, 5, 0, 95)
    assert choose_resize(square)[0] == "crop"
    mixed = Aspect.of([(64, 64)] * 50 + [(384, 64)] * 25 + [(64, 192)] * 25)
    assert (mixed.wide, mixed.tall, mixed.max, mixed.median) == (25, 25, 6.0, 2.0)
    mode, why = choose_resize(mixed)
    assert mode == "squash" and "50 of 100 images (50%) are wider or taller than 4:3 (up to 6:1)" in why
    assert "25% wide, 25% tall" in mixed.summary() and "max 6" in mixed.summary()


def test_preprocess_measures_and_reports_the_choice(tmp_path) -> None:
    wide = draw_offcentre_folder(tmp_path / "wide", classes=2, per_class=10)
    preprocess.run(PreprocessParams(image_size=16, workers=1), seed=0, source=wide, out_dir=tmp_path / "s1")
    manifest = read_json(tmp_path / "s1" / "manifest.json")
    assert manifest["spec"]["resize"] == manifest["resize"]["mode"] == "squash" and manifest["resize"]["auto"]
    assert manifest["resize"]["aspect_ratios"]["count"] == 20 and "from the headers of 20 files" in manifest[
        "resize"]["why"]  # fmt: skip
    photos = make_imagefolder(tmp_path / "photos", classes=2, per_class=6)
    preprocess.run(PreprocessParams(image_size=16, workers=1, resize="pad"), seed=0, source=photos,
                   out_dir=tmp_path / "s2")  # fmt: skip
    manifest = read_json(tmp_path / "s2" / "manifest.json")
    assert manifest["resize"] | {"aspect_ratios": None} == {"mode": "pad", "auto": False, "why": "set in params.yaml",
                                                             "aspect_ratios": None}  # fmt: skip
    assert manifest["spec"]["resize"] == "pad" and manifest["resize"]["aspect_ratios"]["count"] == 12
