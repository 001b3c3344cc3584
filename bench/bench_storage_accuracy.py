"""What storing the shards' pixels as JPEG would cost in accuracy (issue 57, part 3; bench_storage.py measures
bytes and speed, this the model): the default recipe trained on the same shards, raw and round-tripped.

For each mode, every image of every split of `--shards` (the default data's, made by `make run`) is encoded by
Pillow as bench_storage's MODES do and decoded again, and the split written back with the stage's writer
(tasks.images.shards.ShardFile) into a scratch shard directory with the same layout and a manifest naming the new
checksums. The train stage's own function (tasks.train.run) then trains params.yaml's train section on it, once
per seed (the split stays; the training seed changes). Printed per mode: test accuracy on the mode's own test split
(what evaluate would report with such shards) and on the raw test split (what the server sees: it decodes the
upload, not a JPEG of it), mean over the seeds, bytes an image, and the training seconds. Asserts nothing.

    .venv/bin/python -m bench.bench_storage_accuracy [--shards data/shards] [--modes raw jpeg90] [--seeds 42 43]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_storage import MODES, Mode, encode  # noqa: E402
from bench.bench_warm_start import accuracy  # noqa: E402  (a model's test accuracy on a shard directory)
from tasks import train  # noqa: E402
from tasks.core.io import read_json, write_json  # noqa: E402
from tasks.core.params import load_params  # noqa: E402
from tasks.images.shards import MANIFEST, ShardFile, ShardSplit, load_manifest  # noqa: E402

NAMES = {"raw": 0, "jpeg90": 1, "jpeg90-444": 2, "jpeg95": 3, "jpeg95-444": 4}  # --modes -> bench_storage.MODES


def round_trip(image: np.ndarray, mode: Mode) -> tuple[np.ndarray, int]:
    """(3, S, S) uint8 through the mode's encoder and Pillow's decoder, and the encoded size."""
    data = encode(image, mode)
    with Image.open(io.BytesIO(data)) as decoded:
        return np.asarray(decoded.convert("RGB")).transpose(2, 0, 1).copy(), len(data)


def stored_as(shards: Path, mode: Mode, out: Path) -> float:
    """`shards` with every image round-tripped through `mode`, written to `out`; returns bytes an image."""
    manifest = load_manifest(shards)
    size, encoded, count = manifest["image_size"], 0, 0
    out.mkdir(parents=True)
    for split, entry in manifest["splits"].items():
        whole = ShardSplit.open(shards, split)
        start = 0
        for shard in entry["shards"]:
            writer = ShardFile(out / shard["file"], image_size=size)
            rows = whole.span(start, start + shard["count"])
            for image, label in zip(rows, whole.labels[start : start + shard["count"]].tolist(), strict=True):
                if mode.format is None:
                    pixels, nbytes = image, image.nbytes
                else:
                    pixels, nbytes = round_trip(image, mode)
                writer.add(pixels, label)
                encoded, count = encoded + nbytes, count + 1
            shard.update(writer.close())
            start += shard["count"]
    write_json(out / MANIFEST, manifest)
    for name in ("quarantine.json",):
        if (shards / name).is_file():
            write_json(out / name, read_json(shards / name))
    return encoded / max(count, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=Path, default=ROOT / "data" / "shards", help="a shard directory (make run's)")
    parser.add_argument("--modes", nargs="+", default=["raw", "jpeg90"], choices=sorted(NAMES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 43], help="training seeds per mode")
    args = parser.parse_args()
    p = load_params(ROOT / "params.yaml")
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_storage_accuracy_") as name:
        tmp = Path(name)
        for label in args.modes:
            mode = MODES[NAMES[label]]
            shards = tmp / label / "shards"
            per_image = stored_as(args.shards, mode, shards)
            own, served, seconds = [], [], []
            for seed in args.seeds:
                out = tmp / label / f"seed{seed}"
                began = time.perf_counter()
                result = train.run(p.train, seed=seed, shard_dir=shards, model_path=out / "model.pt",
                                   history_path=out / "h.json", plot_path=out / "h.png", runs_dir=out / "runs",
                                   provenance={}, parent_dir=out / "parent")  # fmt: skip
                seconds.append(time.perf_counter() - began)
                own.append(accuracy(result.model_path, shards))
                served.append(accuracy(result.model_path, args.shards))
                print(f"  {mode.name} seed {seed}: test {own[-1]:.4f} (own split), {served[-1]:.4f} (raw split), "
                      f"{seconds[-1]:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
            rows.append((mode, per_image, own, served, seconds))
    size = load_manifest(args.shards)["image_size"]
    print(f"\n### The default recipe on {args.shards} ({size} px), seeds {' '.join(map(str, args.seeds))}\n")
    print("| mode | bytes/image | test acc, own split (per seed) | mean | test acc, raw split (per seed) | mean "
          "| train s |")  # fmt: skip
    print("|---|---:|---|---:|---|---:|---:|")
    for mode, per_image, own, served, seconds in rows:
        print(f"| {mode.name} | {per_image:,.0f} | {' / '.join(f'{a:.4f}' for a in own)} | {statistics.mean(own):.4f} "
              f"| {' / '.join(f'{a:.4f}' for a in served)} | {statistics.mean(served):.4f} "
              f"| {statistics.mean(seconds):.0f} |")  # fmt: skip
    load = os.getloadavg()
    print(f"\nmachine: {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"{time.perf_counter() - started:.0f} s")  # fmt: skip
    print(f"command: .venv/bin/python -m bench.bench_storage_accuracy {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
