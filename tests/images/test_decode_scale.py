"""JPEGs decoded at the smallest DCT scale that covers the output (spec.decode "dct_scaled"): close to a full decode
after the resize, the declared shape kept, EXIF rotations applied, and a spec made before the choice decodes in full."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from tasks.images.imaging import PreprocessSpec, decode_image, decode_sized, load_array

SPEC = PreprocessSpec(image_size=64, mean=(0.5,) * 3, std=(0.5,) * 3, class_names=("a", "b"), decode="dct_scaled")


def photo(width: int, height: int, *, orientation: int | None = None, fmt: str = "JPEG") -> bytes:
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx * 255 // width, yy * 255 // height, (xx + yy) * 127 // (width + height)], axis=-1)
    pixels = np.clip(base + rng.integers(-12, 13, base.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    exif = Image.Exif()
    if orientation:
        exif[0x0112] = orientation
    Image.fromarray(pixels).save(out, fmt, exif=exif.tobytes(), **({"quality": 90} if fmt == "JPEG" else {}))
    return out.getvalue()


def test_a_large_jpeg_is_decoded_at_a_scale_that_still_covers_the_output() -> None:
    data = photo(1200, 900)
    scaled = decode_image(data, draft_size=64)
    assert scaled.size == (150, 113)  # 1/8: both sides still >= 64; 1/16 does not exist
    assert min(decode_image(data, draft_size=200).size) >= 200  # 1/4 (300 x 225), not 1/8 (150 x 113)
    assert decode_image(data).size == (1200, 900)  # no draft_size: every pixel
    full = load_array(data, SPEC.model_copy(update={"decode": "full"})).astype(np.int16)
    diff = np.abs(full - load_array(data, SPEC))
    assert diff.mean() < 1.0 and diff.max() <= 16, (diff.mean(), diff.max())


def test_the_declared_shape_is_the_files_with_its_exif_rotation() -> None:
    image, shape = decode_sized(photo(1200, 900, orientation=6), draft_size=64)
    assert shape == (900, 1200)  # what the aspect census counts, whatever the scale
    assert image.size == (113, 150)  # decoded at 1/8, then turned upright


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
def test_other_formats_are_decoded_in_full(fmt: str) -> None:
    data = photo(600, 400, fmt=fmt)
    assert decode_image(data, draft_size=64).size == (600, 400)
    assert np.array_equal(load_array(data, SPEC), load_array(data, SPEC.model_copy(update={"decode": "full"})))


def test_a_spec_that_does_not_name_its_decode_is_a_full_decode() -> None:
    """Model files made before the choice was recorded were trained on full decodes: they are served alike."""
    old = PreprocessSpec.model_validate({k: v for k, v in SPEC.model_dump().items() if k != "decode"})
    assert old.decode == "full" and old.draft_size() is None and SPEC.draft_size() == 64
    with pytest.raises(ValueError, match="decode 'fast' is not one of"):
        PreprocessSpec.model_validate({**SPEC.model_dump(), "decode": "fast"})
