"""ImageFolders drawn on disk for tests: colour-coded noise (fast to learn) and user-like drawn shapes."""

from __future__ import annotations

import colorsys
from pathlib import Path
from typing import Any

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


def _draw_shape(draw: Any, kind: str, cx: float, cy: float, r: float, fill: tuple[int, ...]) -> None:
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
            _draw_shape(draw, kind, cx, cy, r, fill)
            if rng.random() < 0.2:
                image = image.convert("L")
            suffix = (".jpg", ".png", ".bmp", ".webp")[i % 4]
            image.save(folder / f"{kind}_{i:04d}{suffix}")
    return root


def draw_offcentre_folder(
    root: Path, classes: int, per_class: int, seed: int = 0, max_ratio: float = 6.0, kinds: tuple[str, ...] = SHAPES,
    cluttered: bool = False,
) -> Path:  # fmt: skip
    """Shapes anywhere on canvases whose longer side is 1 to `max_ratio` times the shorter (log-uniform, half of
    them wide, half tall), as scanned glyphs or photos cropped by hand are: a centre crop cuts most subjects off.
    The shape alone tells the class: any colour, on a noisy background of any dull colour; saved as PNG or JPEG.
    The classes are the first `classes` of `kinds`. `cluttered`: smaller shapes in heavier noise, crossed by
    lines of any colour, as photos of real things are: hard to learn from a few images from scratch."""
    from PIL import ImageDraw

    rng = np.random.default_rng(seed)
    for kind in kinds[:classes]:
        folder = root / kind
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            short = int(rng.integers(32, 72))
            long = int(round(short * np.exp(rng.uniform(0, np.log(max_ratio)))))
            w, h = (long, short) if i % 2 else (short, long)
            noise = rng.normal(0, 40 if cluttered else 12, size=(h, w, 3)) + rng.integers(40, 140, size=3)
            image = Image.fromarray(noise.clip(0, 255).astype(np.uint8))
            r = short * (rng.uniform(0.18, 0.35) if cluttered else rng.uniform(0.28, 0.42))
            cx, cy = rng.uniform(r, w - r), rng.uniform(r, h - r)
            fill = tuple(int(v) for v in rng.integers(150, 256, size=3))
            draw = ImageDraw.Draw(image)
            _draw_shape(draw, kind, cx, cy, r, fill)
            for _ in range(3 if cluttered else 0):
                ends = [float(v) for v in rng.uniform(0, 1, 4) * [w, h, w, h]]
                draw.line(ends, fill=tuple(int(v) for v in rng.integers(0, 256, size=3)), width=max(1, short // 24))
            image.save(folder / f"{kind}_{i:04d}{'.png' if i % 3 else '.jpg'}")
    return root


GLYPHS = "0123456789"


def draw_glyph_folder(
    root: Path, per_class: int, seed: int = 0, glyphs: str = GLYPHS, max_ratio: float = 1.0, any_shade: bool = False,
    any_colour: bool = False,
) -> Path:  # fmt: skip
    """Scanned glyphs: one character per image (the class), dark ink on paper of uneven grey, at any size from
    half the canvas to nearly all of it, slightly rotated and off-centre, with scanner noise and blur;
    28-64 px canvases, grayscale PNG or JPEG. A mirrored b is a d; a mirrored 2, 3, 4, 5, 6, 7 or 9 is no digit.
    `max_ratio` > 1: the scan is stretched to an aspect ratio of 1 to `max_ratio` (log-uniform, half wide, half
    tall), glyph and all, as images resized to a fixed box by some other tool are.
    `any_shade`: ink and paper of any two grey levels at least 60 apart, light ink on dark paper as often as not.
    `any_colour`: every other scan is then tinted as coloured paper and ink are (an RGB file), the grey levels kept."""
    from PIL import ImageDraw, ImageFilter, ImageFont

    rng = np.random.default_rng(seed)
    for glyph in glyphs:
        folder = root / f"glyph_{glyph}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            side = int(rng.integers(28, 65))
            long = int(round(side * np.exp(rng.uniform(0, np.log(max_ratio))))) if max_ratio > 1 else side
            w, h = (long, side) if i % 2 else (side, long)
            big = side * 4  # drawn large, then scanned down: antialiased strokes
            paper, ink = int(rng.integers(190, 250)), int(rng.integers(0, 70))
            if any_shade:
                paper, ink = int(rng.integers(0, 256)), int(rng.integers(0, 256))
                while abs(paper - ink) < 60:
                    paper, ink = int(rng.integers(0, 256)), int(rng.integers(0, 256))
            image = Image.new("L", (big, big), paper)
            font = ImageFont.load_default(size=int(big * rng.uniform(0.5, 0.85)))
            draw = ImageDraw.Draw(image)
            centre = (big / 2 + rng.uniform(-0.1, 0.1) * big, big / 2 + rng.uniform(-0.1, 0.1) * big)
            draw.text(centre, glyph, font=font, anchor="mm", fill=ink,
                      stroke_width=int(rng.integers(0, 3)), stroke_fill=ink)  # fmt: skip
            image = image.rotate(float(rng.uniform(-10, 10)), resample=Image.BILINEAR, fillcolor=paper)
            image = image.resize((w, h), Image.BILINEAR).filter(ImageFilter.GaussianBlur(rng.uniform(0, 0.8)))
            pixels = np.asarray(image, np.float32) + rng.normal(0, 8, size=(h, w))
            if any_colour and i % 4 >= 2:  # tinted: grey level x a colour of about grey 1, so the grey image stays
                tint = rng.uniform(0.6, 1.4, size=3)
                pixels = pixels[..., None] * (tint / (tint @ (0.299, 0.587, 0.114)))
            Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(
                folder / f"{glyph}_{i:04d}{'.png' if i % 2 else '.jpg'}"
            )
    return root


# Side views facing right, in unit coordinates (x right, y down): a mirror image of each is still the same thing,
# but no class is a mirror image of another.
FACING = {
    "car": [(-1.0, 0.3), (1.0, 0.3), (1.0, 0.0), (0.3, -0.1), (0.05, -0.5), (-0.7, -0.5), (-0.85, -0.1), (-1.0, 0.0)],
    "fish": [(-1.0, -0.5), (-0.55, 0.0), (-1.0, 0.5), (-0.7, 0.5), (-0.4, 0.15), (0.1, 0.45), (0.7, 0.35),
             (1.0, 0.0), (0.7, -0.35), (0.1, -0.45), (-0.4, -0.15), (-0.7, -0.5)],
    "boot": [(-0.7, -1.0), (-0.1, -1.0), (-0.1, 0.2), (0.9, 0.35), (1.0, 0.7), (-0.7, 0.7)],
    "flag": [(-0.8, -1.0), (-0.65, -1.0), (-0.65, -0.9), (0.9, -0.55), (-0.65, -0.2), (-0.65, 1.0), (-0.8, 1.0)],
    "truck": [(-1.0, 0.35), (1.0, 0.35), (1.0, -0.2), (0.75, -0.6), (0.4, -0.6), (0.4, -0.8), (-1.0, -0.8)],
}  # fmt: skip
WHEELS = {"car": (-0.55, 0.55), "truck": (-0.6, 0.0, 0.7)}


def draw_facing_folder(root: Path, per_class: int, seed: int = 0, kinds: tuple[str, ...] = tuple(FACING)) -> Path:
    """Side views of things that all face right, as product shots and vehicles in profile do: a car, a fish, a boot,
    a flag, a truck, of any colour and size on a noisy background of any dull colour. A mirror image of a car is
    still a car (flips help), yet it looks unlike every training image of its class."""
    from PIL import ImageDraw

    rng = np.random.default_rng(seed)
    for kind in kinds:
        folder = root / kind
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            w, h = int(rng.integers(48, 97)), int(rng.integers(40, 81))
            noise = rng.normal(0, 14, size=(h, w, 3)) + rng.integers(40, 140, size=3)
            image = Image.fromarray(noise.clip(0, 255).astype(np.uint8))
            r = min(w, h) * rng.uniform(0.3, 0.45)
            cx, cy = rng.uniform(r, w - r), rng.uniform(r, h - r)
            stretch = rng.uniform(1.0, 1.3)
            fill = tuple(int(v) for v in rng.integers(150, 256, size=3))
            draw = ImageDraw.Draw(image)
            draw.polygon([(cx + x * r * stretch, cy + y * r) for x, y in FACING[kind]], fill=fill)
            for x in WHEELS.get(kind, ()):
                wx, wy, wr = cx + x * r * stretch, cy + 0.35 * r, 0.22 * r
                draw.ellipse([wx - wr, wy - wr, wx + wr, wy + wr], fill=(20, 20, 20))
            image.save(folder / f"{kind}_{i:04d}{'.png' if i % 3 else '.jpg'}")
    return root


TEXTURES = ("stripes", "checks", "dots", "rings", "blobs", "grain")


def _texture(kind: str, rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A (h, w) pattern in [0, 1]: any scale, angle and phase, so the kind alone tells the class."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    angle, period = rng.uniform(0, np.pi), rng.uniform(5, 12)
    u = (x * np.cos(angle) + y * np.sin(angle)) * 2 * np.pi / period + rng.uniform(0, 2 * np.pi)
    v = (-x * np.sin(angle) + y * np.cos(angle)) * 2 * np.pi / period + rng.uniform(0, 2 * np.pi)
    if kind == "stripes":
        return (np.sin(u) > 0).astype(np.float64)
    if kind == "checks":
        return ((np.sin(u) * np.sin(v)) > 0).astype(np.float64)
    if kind == "dots":
        return ((np.cos(u) + np.cos(v)) > 1.2).astype(np.float64)
    if kind == "rings":
        cy, cx = rng.uniform(0, h), rng.uniform(0, w)
        return (np.sin(np.hypot(x - cx, y - cy) * 2 * np.pi / period) > 0).astype(np.float64)
    from scipy.ndimage import gaussian_filter

    if kind == "blobs":
        field = gaussian_filter(rng.normal(size=(h, w)), sigma=period / 2)
        return (field > np.median(field)).astype(np.float64)
    return (gaussian_filter(rng.normal(size=(h, w)), sigma=0.7) > 0).astype(np.float64)  # grain


def draw_texture_folder(root: Path, per_class: int, seed: int = 0, kinds: tuple[str, ...] = TEXTURES) -> Path:
    """Textures in two colours of any hue, at least 60 grey levels apart (stripes, checks, dots, rings, blobs, grain),
    at any scale, angle and phase, noisy as a photo of a surface is: the class is the pattern, never where or which
    way it lies."""
    rng = np.random.default_rng(seed)
    for kind in kinds:
        folder = root / kind
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            h, w = int(rng.integers(40, 97)), int(rng.integers(40, 97))
            pattern = _texture(kind, rng, h, w)[..., None]
            ink, paper = rng.integers(0, 256, size=(2, 3))
            while abs(float((ink - paper) @ (0.299, 0.587, 0.114))) < 60:  # a pattern one can see, in grey too
                ink, paper = rng.integers(0, 256, size=(2, 3))
            pixels = pattern * ink + (1 - pattern) * paper + rng.normal(0, 18, size=(h, w, 3))
            Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(
                folder / f"{kind}_{i:04d}{'.png' if i % 2 else '.jpg'}"
            )
    return root


def write_digits_folder(root: Path, seed: int = 0, indices: np.ndarray | None = None, max_side: int = 96) -> Path:
    """Real handwritten digits (scikit-learn's bundled `load_digits`: 1,797 scans of 8x8 pixels, 16 grey levels,
    no download) as a messy folder: dark ink on light paper, each upscaled to its own size (16 to `max_side` px,
    aspect 4:5 to 5:4), half of them RGB on tinted paper, PNG or JPEG. `indices`: which of the 1,797 (all)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(seed)
    chosen = np.arange(len(digits.target)) if indices is None else np.asarray(indices)
    for k in chosen.tolist():
        folder = root / f"digit_{digits.target[k]}"
        folder.mkdir(parents=True, exist_ok=True)
        side = int(rng.integers(16, max_side + 1))
        w, h = side, int(round(side * rng.uniform(0.8, 1.25)))
        grey = Image.fromarray((255 - digits.images[k] * (255 / 16)).astype(np.uint8))
        grey = grey.resize((w, h), (Image.NEAREST, Image.BILINEAR, Image.BICUBIC)[k % 3])
        image = grey
        if rng.random() < 0.5:
            paper = rng.uniform(0.75, 1.0, size=3)
            image = Image.fromarray((np.asarray(grey, np.float32)[..., None] * paper).clip(0, 255).astype(np.uint8))
        image.save(folder / f"{k:04d}{'.png' if rng.random() < 0.5 else '.jpg'}")
    return root
