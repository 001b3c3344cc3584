"""The one preprocessing path: image bytes -> RGB uint8 (C, H, W) at the model's input size.

Preprocessing, evaluation, export checks and serving all call `decode_image` + `resize_crop`
and `normalize`, with the `PreprocessSpec` recorded beside the model, so they cannot disagree.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps
from pydantic import BaseModel, ConfigDict

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"})

_RESAMPLE = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
}


class PreprocessSpec(BaseModel):
    """What a model expects: recorded in model.pt and in the ONNX metadata."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    image_size: int
    resize: str = "shorter-side-then-center-crop"
    interpolation: str = "bilinear"
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    channel_order: str = "RGB"
    layout: str = "NCHW"
    class_names: tuple[str, ...]


def is_image_name(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_SUFFIXES and not path.name.startswith(".")


def decode_image(data: bytes) -> Image.Image:
    """Fully decode image bytes to RGB, applying EXIF orientation; raises on unreadable data."""
    with Image.open(io.BytesIO(data)) as img:
        img.load()
        img = ImageOps.exif_transpose(img)
        if img.mode.startswith("I"):  # 16/32-bit integer: scale the 16-bit range to 8 bits
            arr = np.asarray(img, dtype=np.int64)
            shift = 8 if img.mode.startswith("I;16") or arr.max() > 255 else 0
            img = Image.fromarray((np.clip(arr, 0, 65535) >> shift).astype(np.uint8))
        if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
            rgba = img.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            img = Image.alpha_composite(background, rgba)
        return img.convert("RGB")


def resize_crop(img: Image.Image, size: int, interpolation: str = "bilinear") -> np.ndarray:
    """Resize the shorter side to `size`, center-crop to size x size; returns uint8 (3, H, W)."""
    width, height = img.size
    scale = size / min(width, height)
    new_w, new_h = max(size, round(width * scale)), max(size, round(height * scale))
    img = img.resize((new_w, new_h), _RESAMPLE[interpolation])
    left, top = (new_w - size) // 2, (new_h - size) // 2
    img = img.crop((left, top, left + size, top + size))
    return np.ascontiguousarray(np.asarray(img, dtype=np.uint8).transpose(2, 0, 1))


def load_array(data: bytes, spec: PreprocessSpec) -> np.ndarray:
    return resize_crop(decode_image(data), spec.image_size, spec.interpolation)
