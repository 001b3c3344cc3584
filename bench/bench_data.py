"""Data-loading benchmark, side by side on the same images in one run; prints images/s and ratios.

(a) torchvision ImageFolder + the usual transforms + DataLoader, vs (b) the Arrow shard dataset +
the same augmentation, one epoch each over the same (train-split) files, on one core
(torch.set_num_threads(1), num_workers=0); for the pipeline's default augmentation (reflect-pad
crop + flip) and for random-resized-crop + flip. Then the preprocess stage's throughput with 1 and
2 worker processes, runs interleaved, each in a fresh interpreter like the stage itself
(bench.stage_timer), first: its shards feed the loading half. Images: --images DIR, else
data/generated if it is there, else --count images made by tasks.generate in a temporary directory.

    .venv/bin/python -m bench.bench_data [--images DIR] [--count 3000] [--repeats 3] [--json out.json]

Wall-clock numbers: on a shared machine they are noisy; compare the ratios, rerun on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torchvision
from torch.utils.data import DataLoader, Subset
from torchvision import transforms as T

from tasks import generate
from tasks.core.io import read_json
from tasks.core.params import AugmentParams, GenerateParams, PreprocessParams
from tasks.training.augment import Augment
from tasks.training.dataset import ShardDataset

BATCH = 64


def find_images(args: argparse.Namespace, scratch: Path) -> Path:
    if args.images:
        return Path(args.images)
    default = Path("data/generated")
    if default.is_dir() and any(p.is_dir() for p in default.iterdir()):
        return default
    out = scratch / "images"
    print(f"no images given and no data/generated: generating {args.count} with tasks.generate ...", flush=True)
    generate.run(GenerateParams(images_per_class=max(1, args.count // 10), workers=2), seed=42, out_dir=out)
    return out


def best_rate(run_once: Callable[[], int], repeats: int) -> float:
    """Images per second of the fastest of `repeats` runs (the least disturbed by other load)."""
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        count = run_once()
        rates.append(count / (time.perf_counter() - start))
    return max(rates)


@dataclass(frozen=True)
class StageRun:
    rate: float  # images seen per second of wall time
    main_cpu: float  # seconds of CPU in the stage's own process (all its threads)
    decoder_cpu: float  # seconds of CPU in its decoder processes


def time_stage(params: PreprocessParams, images: Path, out: Path) -> StageRun:
    """One run of the preprocess stage in a fresh interpreter (bench.stage_timer): this process has
    torch loaded, the stage does not, and its decoders fork from it. From nothing: shards already in `out`
    would be reused, not decoded (tasks/images/reuse.py)."""
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "bench.stage_timer", "--params", params.model_dump_json(),
               "--images", str(images), "--out", str(out)]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"preprocess failed ({' '.join(command)}):\n{proc.stderr[-3000:]}")
    return StageRun(**json.loads(proc.stdout.strip().splitlines()[-1]))


def epoch(loader: Iterable[tuple[torch.Tensor, torch.Tensor]], normalize: Callable | None = None) -> int:
    count = 0
    for images, labels in loader:
        if normalize is not None:
            images = normalize(images)
        count += len(labels)
    return count


def imagefolder_baseline(images: Path, train_files: list[str], transform: T.Compose) -> DataLoader:
    dataset = torchvision.datasets.ImageFolder(str(images), transform=transform)
    index = {Path(path).relative_to(images).as_posix(): i for i, (path, _) in enumerate(dataset.samples)}
    subset = Subset(dataset, [index[rel] for rel in train_files])  # exactly the shard dataset's images
    return DataLoader(subset, batch_size=BATCH, shuffle=True, num_workers=0)


def loading_rates(
    images: Path, shards: Path, train_files: list[str], size: int, mean: tuple, std: tuple, repeats: int
) -> tuple[list[tuple[str, float, float]], float]:
    """Images/s of one epoch on one core: ImageFolder + torchvision vs the shards, per augmentation."""
    torch.set_num_threads(1)  # one core for both loaders
    norm_mean = torch.tensor(mean).view(1, 3, 1, 1) * 255
    norm_std = torch.tensor(std).view(1, 3, 1, 1) * 255

    def normalize(batch: torch.Tensor) -> torch.Tensor:  # what the training step does to shard batches
        return (batch.float() - norm_mean) / norm_std

    pad = AugmentParams(hflip=True)  # as torchvision's baselines flip
    rrc = AugmentParams(crop="random_resized", hflip=True)
    baselines = {
        "pad crop + flip (default)": T.Compose([
            T.Resize(size), T.CenterCrop(size),
            T.RandomCrop(size, padding=pad.crop_padding, padding_mode="reflect"),
            T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std),
        ]),
        "random resized crop + flip": T.Compose([
            T.RandomResizedCrop(size, scale=rrc.scale, ratio=rrc.ratio),
            T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std),
        ]),
    }  # fmt: skip
    rows = []
    for (name, transform), aug in zip(baselines.items(), (pad, rrc), strict=True):
        folder = imagefolder_baseline(images, train_files, transform)
        dataset = ShardDataset(shards, "train", augment=Augment(aug), seed=42)
        loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=0)
        a = best_rate(lambda folder=folder: epoch(folder), repeats)
        b = best_rate(lambda loader=loader: epoch(loader, normalize), repeats)
        rows.append((name, a, b))
    plain = DataLoader(ShardDataset(shards, "train"), batch_size=BATCH, shuffle=True, num_workers=0)
    raw = best_rate(lambda: epoch(plain, normalize), repeats)
    return rows, raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", help="an ImageFolder (default: data/generated, else generated here)")
    parser.add_argument("--count", type=int, default=3000, help="images to generate when none are given")
    parser.add_argument("--size", type=int, default=64, help="model input side (preprocess.image_size)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each measurement; the best is kept")
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        scratch = Path(tmp)
        images = find_images(args, scratch)
        prep = PreprocessParams(image_size=args.size)

        # Preprocessing throughput: the whole stage (hash, decode, write shards), 1 vs 2 workers, runs
        # interleaved (1, 2, 2, 1, 1, 2, ...) so that load drifting over the bench hits both alike.
        prep_runs: dict[int, list[StageRun]] = {1: [], 2: []}
        for repeat in range(args.repeats):
            for workers in (1, 2) if repeat % 2 == 0 else (2, 1):
                params = prep.model_copy(update={"workers": workers})
                prep_runs[workers].append(time_stage(params, images, scratch / f"shards-{workers}"))
        shards = scratch / "shards-1"
        train_files = [f["path"] for f in read_json(shards / "manifest.json")["files"] if f["split"] == "train"]

        rows, raw = loading_rates(images, shards, train_files, args.size, prep.mean, prep.std, args.repeats)

    load = os.getloadavg()
    print(f"\nimages: {images} ({len(train_files)} train images used for loading, {args.size}px)")
    print(f"machine: {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (noisy if > 0)")
    print("\none epoch, one core (torch threads 1, num_workers 0), batch 64, images/s:")
    print(f"  {'augmentation':30} {'ImageFolder':>12} {'shards':>12} {'ratio':>8}")
    for name, a, b in rows:
        print(f"  {name:30} {a:12.0f} {b:12.0f} {b / a:7.1f}x")
    print(f"  {'shards, no augmentation':30} {'':12} {raw:12.0f}")
    best = {workers: max(runs, key=lambda run: run.rate) for workers, runs in prep_runs.items()}
    pairs = sorted(two.rate / one.rate for one, two in zip(prep_runs[1], prep_runs[2], strict=True))
    print(f"\npreprocess stage (hash + decode + write shards), images/s, best of {args.repeats} interleaved runs:")
    for workers, run in best.items():
        print(
            f"  {workers} worker{'s' if workers > 1 else ' '} {run.rate:8.0f}   "
            f"(CPU: main process {run.main_cpu:.2f} s, decoders {run.decoder_cpu:.2f} s)"
        )
    print(
        f"  ratio of the best runs {best[2].rate / best[1].rate:.2f}x; "
        f"run by run {pairs[0]:.2f}x to {pairs[-1]:.2f}x, median {pairs[len(pairs) // 2]:.2f}x"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "loading_images_per_second": {name: {"imagefolder": a, "shards": b} for name, a, b in rows},
                    "shards_no_augmentation": raw,
                    "preprocess_images_per_second": {str(k): run.rate for k, run in best.items()},
                    "preprocess_runs": {str(k): [vars(run) for run in runs] for k, runs in prep_runs.items()},
                    "load_average": load,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
