"""ImageFolders drawn on disk for tests: colour-coded noise (fast to learn) and user-like drawn shapes."""

from __future__ import annotations

import colorsys
from pathlib import Path

import numpy as np
from PIL import Image


def make_imagefolder(root: Path, classes: int = 3, per_class: int = 20, seed: int = 0) -> Path:
    """Classes told apart by colour, sizes and formats varied."""
    rng = np.random.default_rng(seed)
    for c in range(classes):
        folder = root / f"class_{c}"
        folder.mkdir(parents=True, exist_ok=True)
        tint = np.array([(c * 97) % 256, (c * 53 + 80) % 256, (c * 191 + 30) % 256])
        for i in range(per_class):
            h, w = rng.integers(20, 80, size=2)
            pixels = (rng.random((h, w, 3)) * 60 + tint * 0.7).clip(0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(folder / (f"{i:03d}.png" if i % 2 else f"{i:03d}.jpg"))
    return root


SHAPES = ("circle", "square", "triangle", "diamond", "star", "cross", "ring", "hexagon", "pentagon", "bar")


def _shape_polygon(kind: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    sides = {"triangle": 3, "diamond": 4, "pentagon": 5, "hexagon": 6}
    if kind in sides:
        n = sides[kind]
        return [(cx + r * np.sin(2 * np.pi * k / n), cy - r * np.cos(2 * np.pi * k / n)) for k in range(n)]
    if kind == "star":
        return [(cx + (r if k % 2 == 0 else r * 0.45) * np.sin(np.pi * k / 5),
                 cy - (r if k % 2 == 0 else r * 0.45) * np.cos(np.pi * k / 5)) for k in range(10)]  # fmt: skip
    raise ValueError(kind)


def draw_shapes_folder(root: Path, classes: int, per_class: int, seed: int = 0) -> Path:
    """A user-like ImageFolder of drawn shapes: one shape per image (mirror-symmetric, so a flip keeps
    the class) in the class's hue on a dull background, at a random size and place inside the central square
    (the part preprocessing keeps); images of 40-200 px, aspect 3:4 to 4:3, some grayscale, saved as
    JPEG, PNG, BMP or WebP."""
    from PIL import ImageDraw

    rng = np.random.default_rng(seed)
    for index, kind in enumerate(SHAPES[:classes]):
        folder = root / kind
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            w = int(rng.integers(40, 200))
            h = int(w * rng.uniform(0.75, 1.34))  # photo-like aspect ratios
            # Each class has its shape and its hue (jittered), as in many real datasets colour carries
            # part of the class; the background is any dull colour.
            background = tuple(int(v) for v in rng.integers(40, 140) + rng.integers(-30, 30, size=3))
            hue = (index / classes + rng.uniform(-0.03, 0.03)) % 1.0
            fill = tuple(int(255 * v) for v in colorsys.hsv_to_rgb(hue, rng.uniform(0.6, 1.0), rng.uniform(0.7, 1.0)))
            image = Image.new("RGB", (w, h), background)
            draw = ImageDraw.Draw(image)
            # Inside the central square, which preprocessing keeps (shorter side resized, centre crop).
            side = min(w, h)
            r = side * rng.uniform(0.2, 0.4)
            cx = (w - side) / 2 + rng.uniform(r, side - r)
            cy = (h - side) / 2 + rng.uniform(r, side - r)
            box = (cx - r, cy - r, cx + r, cy + r)
            if kind == "circle":
                draw.ellipse(box, fill=fill)
            elif kind == "ring":
                draw.ellipse(box, outline=fill, width=max(2, int(r * 0.3)))
            elif kind == "square":
                draw.rectangle((cx - r * 0.8, cy - r * 0.8, cx + r * 0.8, cy + r * 0.8), fill=fill)
            elif kind == "bar":
                draw.rectangle((cx - r, cy - r * 0.3, cx + r, cy + r * 0.3), fill=fill)
            elif kind == "cross":
                draw.rectangle((cx - r, cy - r * 0.25, cx + r, cy + r * 0.25), fill=fill)
                draw.rectangle((cx - r * 0.25, cy - r, cx + r * 0.25, cy + r), fill=fill)
            else:
                draw.polygon(_shape_polygon(kind, cx, cy, r), fill=fill)
            if rng.random() < 0.2:
                image = image.convert("L")
            suffix = (".jpg", ".png", ".bmp", ".webp")[i % 4]
            image.save(folder / f"{kind}_{i:04d}{suffix}")
    return root
