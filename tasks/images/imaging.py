"""The one preprocessing path: image bytes -> RGB uint8 (C, H, W) at the model's input size.

Preprocessing, evaluation, export checks and serving all call `decode_image` + `to_square`
(or `load_array`), with the `PreprocessSpec` recorded beside the model, so they cannot disagree.
How an image becomes a square is fastai's choice of three (`RESIZE_MODES`): crop, squash or pad.
A JPEG is decoded at the smallest DCT scale (1/2, 1/4, 1/8: libjpeg's own) whose both sides still cover the
output (`DECODE_MODES` "dct_scaled", the spec's `decode`), so a 12 MP photo costs what a 224 px input needs;
the resize that follows is the same.
Bad bytes raise `ImageError` with a reason code (the same codes as the quarantine report).
"""

from __future__ import annotations

import io
import os
import re

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError
from pydantic import BaseModel, ConfigDict, field_validator

IMAGE_SUFFIXES = frozenset(
    {".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".apng", ".bmp", ".dib", ".gif", ".tif", ".tiff", ".webp"}
    | {".pbm", ".pgm", ".ppm", ".pnm", ".tga", ".ico"}
)

_RESAMPLE = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
}
_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})
# fastai's ResizeMethod names and meanings (fastai.vision.augment.Resize):
#   crop:   the shorter side to the size, then the centre square (what falls outside is cut off)
#   squash: both sides to the size, the aspect ratio not kept (nothing cut off, the subject distorted)
#   pad:    the longer side to the size, the rest filled with black (fastai's pad_mode="zeros")
RESIZE_MODES = ("crop", "squash", "pad")
LEGACY_CROP = "shorter-side-then-center-crop"  # how model files made before the modes existed name crop
# full: every pixel decoded (what every model file made before the choice was recorded did);
# dct_scaled: a JPEG is decoded at the largest libjpeg scale 1/s (s in 8, 4, 2) that keeps both sides >= the
# output size, the other formats in full. Both sides >= size covers crop (shorter side), squash and pad.
DECODE_MODES = ("full", "dct_scaled")
EXIF_ORIENTATION = 0x0112
TRANSPOSED = frozenset({5, 6, 7, 8})  # EXIF orientations that swap width and height


class ImageError(ValueError):
    """Image bytes that cannot be used; `reason` is a stable code, `detail` says what was found."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


class PreprocessSpec(BaseModel):
    """What a model expects: recorded in model.pt and in the ONNX metadata."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    image_size: int
    resize: str = "crop"  # one of RESIZE_MODES
    interpolation: str = "bilinear"
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    channel_order: str = "RGB"
    layout: str = "NCHW"
    class_names: tuple[str, ...]
    decode: str = "full"  # one of DECODE_MODES; a spec that does not name it comes from a model made before it

    @field_validator("decode")
    @classmethod
    def _known_decode(cls, value: str) -> str:
        if value not in DECODE_MODES:
            raise ValueError(f"decode {value!r} is not one of {list(DECODE_MODES)}")
        return value

    def draft_size(self) -> int | None:
        """The side both decoded sides must keep (dct_scaled), or None for a full decode."""
        return self.image_size if self.decode == "dct_scaled" else None

    @field_validator("resize")
    @classmethod
    def _known_mode(cls, value: str) -> str:
        value = "crop" if value == LEGACY_CROP else value
        if value not in RESIZE_MODES:
            raise ValueError(f"resize {value!r} is not one of {list(RESIZE_MODES)}")
        return value


def is_image_name(path: str | os.PathLike[str]) -> bool:
    """An image by name: a known suffix (any case), not hidden. String operations only: discovery
    calls this for every file of a folder."""
    name = os.path.basename(os.fspath(path))
    return not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_SUFFIXES


def _clean(exc: BaseException) -> str:
    """The message without object addresses, so reports made from it are byte-stable."""
    text = re.sub(r" ?<[^>]* at 0x[0-9a-f]+>", "", str(exc)).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _scale_to_8bit(img: Image.Image) -> Image.Image:
    """16-bit (I;16*, or I holding 0..65535) and float images -> L, scaled to 0..255, never clipped."""
    arr = np.asarray(img)
    if img.mode == "F":
        low, high = float(arr.min(initial=0.0)), float(arr.max(initial=0.0))
        if low < 0 or high > 255 or not np.isfinite(arr).all():
            raise ImageError("unsupported_mode", f"float pixels outside 0..255 (min {low:g}, max {high:g})")
        scaled = np.rint(arr * 255.0) if high <= 1.0 else np.rint(arr)
        return Image.fromarray(scaled.astype(np.uint8))
    low, high = int(arr.min(initial=0)), int(arr.max(initial=0))
    if low < 0 or high > 65535:
        raise ImageError("unsupported_mode", f"{img.mode} pixels outside the 16-bit range (min {low}, max {high})")
    # Round(v * 255 / 65535): 0 -> 0 and 65535 -> 255 exactly.
    scaled = (arr.astype(np.uint32) * 255 + 32767) // 65535
    return Image.fromarray(scaled.astype(np.uint8))


def to_rgb(img: Image.Image) -> Image.Image:
    """Any Pillow mode -> RGB: alpha composited on white, palettes expanded, high bit depths scaled."""
    if img.mode.startswith("I") or img.mode == "F":
        img = _scale_to_8bit(img)
    if img.mode in _ALPHA_MODES or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(background, rgba)
    try:
        return img.convert("RGB")
    except ValueError as exc:
        raise ImageError("unsupported_mode", f"mode {img.mode}: {_clean(exc)}") from None


def decode_image(
    data: bytes, *, max_pixels: int | None = None, min_side: int = 1, limit: str = "preprocess.max_pixels",
    draft_size: int | None = None,
) -> Image.Image:  # fmt: skip
    """Decode image bytes to RGB (first frame, EXIF orientation applied); `draft_size`: a JPEG is decoded at
    the smallest DCT scale whose both sides stay >= it (the spec's `draft_size()`), every other image in full.

    The pixel count in the header is checked against `max_pixels` (the params key `limit`) before any pixel
    is decoded.
    Raises ImageError with reason empty_file, not_an_image, decompression_bomb, truncated,
    too_small, unsupported_mode or decode_error.
    """
    return decode_sized(data, max_pixels=max_pixels, min_side=min_side, limit=limit, draft_size=draft_size)[0]


def decode_sized(
    data: bytes, *, max_pixels: int | None = None, min_side: int = 1, limit: str = "preprocess.max_pixels",
    draft_size: int | None = None,
) -> tuple[Image.Image, tuple[int, int]]:  # fmt: skip
    """`decode_image`, and the (width, height) the file declares, EXIF orientation applied: what the image
    measures whatever scale it was decoded at (the aspect-ratio census counts it)."""
    if not data:
        raise ImageError("empty_file", "zero bytes")
    try:
        img = Image.open(io.BytesIO(data))
    except UnidentifiedImageError as exc:
        raise ImageError("not_an_image", _clean(exc)) from None
    except Image.DecompressionBombError as exc:
        raise ImageError("decompression_bomb", _clean(exc)) from None
    except Exception as exc:  # any decoder failure on untrusted bytes is a property of the file
        raise ImageError(_failure_reason(exc), _clean(exc)) from None
    with img:
        width, height = img.size
        if max_pixels is not None and width * height > max_pixels:
            raise ImageError(
                "decompression_bomb",
                f"{width}x{height} = {width * height} pixels > {limit} {max_pixels}",
            )
        try:
            if draft_size is not None and img.format == "JPEG" and min(width, height) >= 2 * draft_size:
                img.draft(img.mode, (draft_size, draft_size))  # libjpeg's scale: both sides stay >= draft_size
            img.load()
            orientation = img.getexif().get(EXIF_ORIENTATION)
            ImageOps.exif_transpose(img, in_place=True)
        except Exception as exc:
            raise ImageError(_failure_reason(exc), _clean(exc)) from None
        if min(width, height) < min_side:
            raise ImageError("too_small", f"{width}x{height}: shorter side < preprocess.min_side {min_side}")
        declared = (height, width) if orientation in TRANSPOSED else (width, height)
        return to_rgb(img), declared


def _failure_reason(exc: BaseException) -> str:
    if isinstance(exc, Image.DecompressionBombError):
        return "decompression_bomb"
    if isinstance(exc, EOFError) or "truncated" in str(exc).lower():
        return "truncated"
    return "decode_error"


def resize_crop(img: Image.Image, size: int, interpolation: str = "bilinear") -> np.ndarray:
    """crop: resize the shorter side to `size`, center-crop to size x size; returns uint8 (3, H, W)."""
    width, height = img.size
    scale = size / min(width, height)
    new_w, new_h = max(size, round(width * scale)), max(size, round(height * scale))
    img = img.resize((new_w, new_h), _RESAMPLE[interpolation])
    left, top = (new_w - size) // 2, (new_h - size) // 2
    img = img.crop((left, top, left + size, top + size))
    return _chw(img)


def to_square(img: Image.Image, size: int, mode: str = "crop", interpolation: str = "bilinear") -> np.ndarray:
    """An RGB image -> uint8 (3, size, size) by one of RESIZE_MODES."""
    if mode == "crop":
        return resize_crop(img, size, interpolation)
    if mode == "squash":
        return _chw(img.resize((size, size), _RESAMPLE[interpolation]))
    if mode != "pad":
        raise ValueError(f"resize mode {mode!r} is not one of {list(RESIZE_MODES)}")
    width, height = img.size
    scale = size / max(width, height)
    new_w, new_h = min(size, max(1, round(width * scale))), min(size, max(1, round(height * scale)))
    canvas = Image.new("RGB", (size, size))
    canvas.paste(img.resize((new_w, new_h), _RESAMPLE[interpolation]), ((size - new_w) // 2, (size - new_h) // 2))
    return _chw(canvas)


def _chw(img: Image.Image) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(img, dtype=np.uint8).transpose(2, 0, 1))


def load_array(data: bytes, spec: PreprocessSpec, *, max_pixels: int | None = None, min_side: int = 1,
               limit: str = "preprocess.max_pixels") -> np.ndarray:  # fmt: skip
    """Image bytes -> uint8 (3, S, S) exactly as the model was trained on."""
    image = decode_image(data, max_pixels=max_pixels, min_side=min_side, limit=limit, draft_size=spec.draft_size())
    return to_square(image, spec.image_size, spec.resize, spec.interpolation)


def normalize_array(images: np.ndarray, spec: PreprocessSpec) -> np.ndarray:
    """uint8 (N, 3, H, W) -> float32 normalised with the spec's mean and std, in float32 arithmetic.

    The same operations, in the same order and precision, as training's `tasks.training.models.normalize`
    on torch tensors, so the two give identical values (tests/release/test_inference.py checks it)."""
    mean = np.asarray(spec.mean, dtype=np.float32).reshape(1, 3, 1, 1) * np.float32(255.0)
    std = np.asarray(spec.std, dtype=np.float32).reshape(1, 3, 1, 1) * np.float32(255.0)
    return (images.astype(np.float32) - mean) / std
