"""Preprocess on photos against the least work that gives its output, side by side on the same files in one run.

(a) the reference: DCT-scaled decode (Pillow's `draft`), EXIF, RGB, resize, centre crop, in a 2-process Pool, no
hashing, nothing written; (b) the preprocess stage with `decode: dct_scaled` and (c) with `decode: full`, each in a
fresh interpreter timed from outside (start-up, imports, hashing, the aspect probe and the shard writes count), on
an empty shard folder. Then the pixel difference of dct_scaled against full on the same images (after resize).

    .venv/bin/python -m bench.bench_decode --images DIR [--size 224] [--repeats 2]

DIR: an ImageFolder of JPEGs; `python -m bench.photos DIR --count 240 --size 4032x3024` makes phone-size ones.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

ROOT = Path(__file__).resolve().parents[1]


def reference_one(args: tuple[str, int]) -> np.ndarray:
    path, size = args
    with Image.open(path) as img:
        img.draft(img.mode, (size, size))
        img.load()
        img = ImageOps.exif_transpose(img).convert("RGB")
        scale = size / min(img.size)
        w, h = max(size, round(img.width * scale)), max(size, round(img.height * scale))
        img = img.resize((w, h), Image.Resampling.BILINEAR)
        left, top = (w - size) // 2, (h - size) // 2
        return np.asarray(img.crop((left, top, left + size, top + size)))


def reference(files: list[str], size: int) -> float:
    start = time.perf_counter()
    with Pool(2) as pool:
        for _ in pool.imap(reference_one, [(f, size) for f in files], chunksize=4):
            pass
    return time.perf_counter() - start


def stage(images: Path, size: int, decode: str) -> float:
    """`python -m bench.stage_timer` in a fresh interpreter, timed from outside: the stage's run() as DVC's
    command runs it, with the interpreter's start-up and every import."""
    with tempfile.TemporaryDirectory() as out:
        params = {"image_size": size, "resize": "crop", "decode": decode, "workers": 2}
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "bench.stage_timer", "--params", json.dumps(params), "--images",
                        str(images), "--out", str(Path(out) / "shards")], check=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        return time.perf_counter() - start


def pixel_difference(files: list[str], size: int) -> tuple[float, int]:
    from tasks.images.imaging import PreprocessSpec, load_array

    spec = PreprocessSpec(image_size=size, mean=(0.5,) * 3, std=(0.5,) * 3, class_names=("a",))
    diffs = []
    for f in files[:40]:
        data = Path(f).read_bytes()
        full = load_array(data, spec.model_copy(update={"decode": "full"})).astype(np.int16)
        diffs.append(np.abs(full - load_array(data, spec.model_copy(update={"decode": "dct_scaled"}))))
    stacked = np.stack(diffs)
    return float(stacked.mean()), int(stacked.max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=Path, required=True)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    files = sorted(str(p) for p in args.images.rglob("*.jpg"))
    times: dict[str, list[float]] = {"reference": [], "dct_scaled": [], "full": []}
    for _ in range(args.repeats):  # interleaved: a slow moment of a shared machine hits each alike
        times["reference"].append(reference(files, args.size))
        times["dct_scaled"].append(stage(args.images, args.size, "dct_scaled"))
        times["full"].append(stage(args.images, args.size, "full"))
    best = {k: min(v) for k, v in times.items()}
    mean, worst = pixel_difference(files, args.size)
    print(f"{len(files)} JPEGs under {args.images}, {args.size} px, {os.cpu_count()} cores; best of {args.repeats}")
    print("| run | s | images/s | speed vs the reference |")
    print("|---|---|---|---|")
    for name in times:
        print(f"| {name} | {best[name]:.1f} | {len(files) / best[name]:.1f} | {best['reference'] / best[name]:.2f} |")
    print(f"dct_scaled vs full after resize, 40 images: mean |diff| {mean:.3f}, max {worst} (of 255)")


if __name__ == "__main__":
    main()
