"""Procedural drawing for the default dataset: (class index, RNG, width, height) -> one RGB image.

Each image shows one large class-defining shape inside the central square, on a textured
background with smaller distractor shapes of other classes, occluding lines, noise and blur.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

# Every shape is mirror-symmetric, so a horizontal flip never changes the class.
CLASS_NAMES: tuple[str, ...] = (
    "circle",
    "triangle",
    "square",
    "pentagon",
    "hexagon",
    "star",
    "cross",
    "ring",
    "crescent",
    "heart",
)

_SUPERSAMPLE = 2  # masks are drawn at 2x and reduced, for anti-aliased edges
_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)  # ITU-R 601-2, as PIL convert("L")


@dataclass(frozen=True)
class Style:
    """Ranges one image's nuisance parameters are drawn from."""

    object_scale: tuple[float, float]  # object radius / half the central square's side
    contrast: tuple[float, float]  # luminance difference object vs background, 0..255
    camouflage: bool  # object colours taken from the background's, so hue does not help
    distractors: tuple[int, int]  # inclusive count of smaller shapes of other classes
    occluders: tuple[int, int]  # inclusive count of thin lines drawn over everything
    noise: tuple[float, float]  # grain sigma, 0..255
    blur: tuple[float, float]  # Gaussian blur radius / shorter side


# Most images are clear but cluttered; a small share is camouflaged and degraded, which sets
# the accuracy ceiling (about 0.95 for resnet18 after 6 epochs) independently of training luck.
CLEAR = Style((0.6, 0.9), (70.0, 130.0), False, (0, 2), (0, 1), (0.0, 4.0), (0.0, 0.005))
HARD = Style((0.25, 0.45), (3.0, 12.0), True, (2, 5), (1, 3), (6.0, 14.0), (0.005, 0.02))
HARD_FRACTION = 0.05
BACKGROUND_SPREAD = 50.0  # luminance range of the low-frequency background texture
DISTRACTOR_SCALE = (0.1, 0.25)  # relative to the object radius
NOISE_GRID = 80  # grain cells across the shorter side, so grain survives the resize to 64


def _regular(n: int, rng: np.random.Generator, jitter: float = 0.04) -> list[np.ndarray]:
    t = np.arange(n) * (2 * math.pi / n) - math.pi / 2
    radius = 1 + rng.uniform(-jitter, jitter, n)
    return [np.stack([radius * np.cos(t), radius * np.sin(t)], 1)]


def _circle(radius: float = 1.0, dx: float = 0.0, points: int = 48) -> np.ndarray:
    t = np.linspace(0, 2 * math.pi, points, endpoint=False)
    return np.stack([dx + radius * np.cos(t), radius * np.sin(t)], 1)


def _outline(kind: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Unit-radius polygons of one shape; the first is filled, any further ones are cut out."""
    name = CLASS_NAMES[kind]
    if name == "circle":
        return [_circle()]
    if name in ("triangle", "square", "pentagon", "hexagon"):
        return _regular({"triangle": 3, "square": 4, "pentagon": 5, "hexagon": 6}[name], rng)
    if name == "star":
        inner = rng.uniform(0.38, 0.52)
        t = np.arange(10) * (math.pi / 5) - math.pi / 2
        radius = np.where(np.arange(10) % 2 == 0, 1.0, inner)
        return [np.stack([radius * np.cos(t), radius * np.sin(t)], 1)]
    if name == "cross":
        a = rng.uniform(0.22, 0.36)
        corners = [(-a, -1), (a, -1), (a, -a), (1, -a), (1, a), (a, a), (a, 1), (-a, 1), (-a, a), (-1, a), (-1, -a)]
        return [np.array([*corners, (-a, -a)], dtype=float)]
    if name == "ring":
        return [_circle(), _circle(rng.uniform(0.45, 0.68))]
    if name == "crescent":
        return [_circle(), _circle(rng.uniform(0.8, 1.0), dx=rng.uniform(0.35, 0.6))]
    t = np.linspace(0, 2 * math.pi, 64, endpoint=False)  # heart
    x = 16 * np.sin(t) ** 3
    y = -(13 * np.cos(t) - 5 * np.cos(2 * t) - 2 * np.cos(3 * t) - np.cos(4 * t))
    pts = np.stack([x, y - 2.5], 1)
    return [pts / np.hypot(pts[:, 0], pts[:, 1]).max()]


def _mask(
    kind: int, rng: np.random.Generator, size: tuple[int, int], center: tuple[float, float], radius: float
) -> tuple[Image.Image, int, int]:
    """An anti-aliased 'L' mask of one randomly rotated, slightly stretched shape, cropped to its
    bounding box within the image; returns the mask and its top-left corner in the image."""
    polys = _outline(kind, rng)
    angle = rng.uniform(0, 2 * math.pi)
    stretch = rng.uniform(0.8, 1.0)
    rot = np.array([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]])
    x0 = max(0, math.floor(center[0] - radius * 1.1))
    y0 = max(0, math.floor(center[1] - radius * 1.1))
    x1 = min(size[0], math.ceil(center[0] + radius * 1.1))
    y1 = min(size[1], math.ceil(center[1] + radius * 1.1))
    s = _SUPERSAMPLE
    mask = Image.new("L", (max(1, x1 - x0) * s, max(1, y1 - y0) * s), 0)
    draw = ImageDraw.Draw(mask)
    for i, poly in enumerate(polys):
        pts = ((poly * [stretch, 1.0]) @ rot.T * radius + center - (x0, y0)) * s
        draw.polygon([(float(x), float(y)) for x, y in pts], fill=0 if i else 255)
    return mask.reduce(s), x0, y0


def _colour(rng: np.random.Generator, luma: float) -> np.ndarray:
    """A random colour shifted to the requested luminance, so grayscale copies keep the contrast."""
    rgb = rng.uniform(0, 255, 3).astype(np.float32)
    return np.clip(rgb + (luma - float(rgb @ _LUMA)), 0, 255)


def _layer(rng: np.random.Generator, width: int, height: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A (height, width, 3) blend of colours a and b through a smooth random field."""
    cells = int(rng.integers(2, 7))
    grid = Image.fromarray(rng.uniform(0, 255, (cells, cells)).astype(np.uint8))
    t = np.asarray(grid.resize((width, height), Image.Resampling.BICUBIC), np.float32) / 255.0
    return a * (1 - t[..., None]) + b * t[..., None]


def _paste(canvas: np.ndarray, layer: np.ndarray, placed: tuple[Image.Image, int, int]) -> None:
    """Alpha-blend `layer` (a colour or a canvas-sized array) into `canvas` through the mask."""
    mask, x0, y0 = placed
    alpha = np.asarray(mask, np.float32)[..., None] / 255.0
    region = np.s_[y0 : y0 + alpha.shape[0], x0 : x0 + alpha.shape[1]]
    if layer.ndim == 3:
        layer = layer[region]
    canvas[region] = canvas[region] * (1 - alpha) + alpha * layer


def _grain(rng: np.random.Generator, width: int, height: int, sigma: float) -> np.ndarray:
    """Gaussian noise with cells sized relative to the image, upsampled to (height, width, 3)."""
    cell = max(1.0, min(width, height) / NOISE_GRID)
    gw, gh = max(1, round(width / cell)), max(1, round(height / cell))
    noise = rng.standard_normal((3, gh, gw), dtype=np.float32) * sigma
    if (gw, gh) == (width, height):
        return noise.transpose(1, 2, 0)
    size, bilinear = (width, height), Image.Resampling.BILINEAR
    return np.stack([np.asarray(Image.fromarray(ch, "F").resize(size, bilinear)) for ch in noise], 2)


def draw(class_index: int, rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """Draw one RGB image of class `class_index` (an index into CLASS_NAMES)."""
    if not 0 <= class_index < len(CLASS_NAMES):
        raise ValueError(f"class_index {class_index} is outside 0..{len(CLASS_NAMES) - 1}")
    style = HARD if rng.random() < HARD_FRACTION else CLEAR
    side = min(width, height)
    bg_luma = rng.uniform(40, 215)
    spread = rng.uniform(0.3, 1.0) * BACKGROUND_SPREAD
    bg_a, bg_b = _colour(rng, bg_luma - spread / 2), _colour(rng, bg_luma + spread / 2)
    canvas = _layer(rng, width, height, bg_a, bg_b)

    radius = rng.uniform(*style.object_scale) * side / 2
    others = [k for k in range(len(CLASS_NAMES)) if k != class_index]
    for _ in range(int(rng.integers(style.distractors[0], style.distractors[1] + 1))):
        kind = others[int(rng.integers(len(others)))]
        centre = (rng.uniform(0, width), rng.uniform(0, height))
        mask = _mask(kind, rng, (width, height), centre, radius * rng.uniform(*DISTRACTOR_SCALE))
        _paste(canvas, _colour(rng, rng.uniform(20, 235)), mask)

    # The object stays inside the central square, which survives the shorter-side centre crop.
    slack = side / 2 - radius
    centre = (width / 2 + rng.uniform(-slack, slack), height / 2 + rng.uniform(-slack, slack))
    shift = rng.uniform(*style.contrast) * (1 if rng.random() < 0.5 else -1)
    if not 10 <= bg_luma + shift <= 245:
        shift = -shift
    if style.camouflage:
        obj_a, obj_b = bg_a + shift, bg_b + shift
    else:
        inner = rng.uniform(0, 0.5) * BACKGROUND_SPREAD
        obj_a, obj_b = _colour(rng, bg_luma + shift - inner / 2), _colour(rng, bg_luma + shift + inner / 2)
    obj = _layer(rng, width, height, obj_a, obj_b)
    _paste(canvas, obj, _mask(class_index, rng, (width, height), centre, radius))

    img = Image.fromarray(np.clip(canvas, 0, 255).astype(np.uint8))
    pen = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(style.occluders[0], style.occluders[1] + 1))):
        ends = rng.uniform(0, 1, 4) * [width, height, width, height]
        colour = tuple(int(c) for c in _colour(rng, rng.uniform(20, 235)))
        thickness = max(1, round(side * rng.uniform(0.01, 0.03)))
        pen.line([tuple(ends[:2]), tuple(ends[2:])], fill=colour, width=thickness)

    arr = np.asarray(img, np.float32) + _grain(rng, width, height, rng.uniform(*style.noise))
    img = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))
    blur = rng.uniform(*style.blur) * side
    return img.filter(ImageFilter.GaussianBlur(blur)) if blur >= 0.3 else img
