"""Photo-like JPEGs for the scale benchmarks: smooth light, textured surfaces and a subject per class, at the sizes
teams bring (public datasets about 500 x 375, phones 4032 x 3024), quality 90, some with an EXIF rotation.

    .venv/bin/python -m bench.photos OUT --count 4000 [--size 500x375] [--classes 10] [--seed 0] [--start 0]

Drawn small and upsampled, then given sensor noise, so each costs a few ms to make and decodes like a photo
(entropy in every 8x8 block). `--start` numbers the files, so a second call adds new, distinct photos.
"""

from __future__ import annotations

import argparse
import io
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter


def photo(index: int, label: int, size: tuple[int, int], seed: int) -> bytes:
    rng = np.random.default_rng([seed, index])
    width, height = size
    small = (max(8, width // 8), max(8, height // 8))
    yy, xx = np.mgrid[0 : small[1], 0 : small[0]].astype(np.float32)
    base = rng.uniform(40, 200, 3)
    light = (xx / small[0] * rng.uniform(-60, 60) + yy / small[1] * rng.uniform(-60, 60))[..., None]
    canvas = Image.fromarray(np.clip(base + light, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(canvas)
    hue = np.array([(label * 37) % 256, (label * 91) % 256, (label * 173) % 256])
    cx, cy, r = small[0] * rng.uniform(0.3, 0.7), small[1] * rng.uniform(0.3, 0.7), min(small) * rng.uniform(0.15, 0.35)
    box = (cx - r, cy - r, cx + r, cy + r)
    if label % 2:
        draw.ellipse(box, fill=tuple(int(v) for v in hue))
    else:
        draw.rectangle(box, fill=tuple(int(v) for v in hue))
    img = canvas.filter(ImageFilter.GaussianBlur(0.7)).resize(size, Image.Resampling.BICUBIC)
    pixels = np.asarray(img, dtype=np.int16) + rng.integers(-10, 11, (height, width, 3), dtype=np.int16)
    out = io.BytesIO()
    exif = Image.Exif()
    if rng.random() < 0.2:
        exif[0x0112] = 6  # a phone held upright
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=90, exif=exif.tobytes())
    return out.getvalue()


def _write(out: Path, size: tuple[int, int], classes: int, seed: int, index: int) -> None:
    label = index % classes
    path = out / f"class_{label}" / f"photo_{index:06d}.jpg"
    path.write_bytes(photo(index, label, size, seed))


def make_photos(out: Path, count: int, *, size: tuple[int, int] = (500, 375), classes: int = 10, seed: int = 0,
                start: int = 0, workers: int = 2) -> Path:  # fmt: skip
    for label in range(classes):
        (out / f"class_{label}").mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(partial(_write, out, size, classes, seed), range(start, start + count), chunksize=32))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--count", type=int, default=4000)
    parser.add_argument("--size", default="500x375")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", type=int, default=0)
    args = parser.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    make_photos(args.out, args.count, size=(width, height), classes=args.classes, seed=args.seed, start=args.start)


if __name__ == "__main__":
    main()
