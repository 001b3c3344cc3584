"""Peak memory of the passes that read a whole split, streamed a block at a time against the whole split in RAM.

    .venv/bin/python bench/bench_memory.py                     # 40,000 images of 224 px: 5.6 GB of shards
    .venv/bin/python bench/bench_memory.py --images 12000      # quick: 1.7 GB of shards, 2 min 16 s on 2 cores
    .venv/bin/python bench/bench_memory.py --keep DIR          # keep the shards; --shards DIR measures them again

Synthetic shards (tests/helpers/shard_dirs.py: random pixels, train/val/test 80/10/10) are written once. Then each
pass runs in a fresh interpreter, once as the code runs it now (`streamed`: ShardSplit.blocks) and once as it ran
before issue 57 (`whole`: ShardSplit.all_images(), one array per split, given to the same predictors):

- label errors: evaluate's `_label_errors`, every split scored (the train split is the large one);
- score_images: the test split, as check_regression and the nightly score it (ONNX, onnxruntime);
- training val: the val split as training reads it, `validate` then `calibrate` (Start.data's split).

Peak RSS is the kernel's (wait4's ru_maxrss): it counts the pages of the memory-mapped shards that a pass touched,
which are page cache the kernel drops under pressure without writing anything. Peak heap is RssAnon, sampled every
10 ms in the pass's own process: the memory a pass needs. `split` is what all_images() allocates (N x 3 x S x S
bytes). The first row, `imports`, is the floor: an interpreter with the modules and the model, and no pass. Above
it, both modes hold one batch as float32 (at batch 256 and 224 px, 154 MB and its temporaries). The models are
tiny, so what is measured is the data path: a real model adds its weights and one batch's activations to both.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file: the project's packages

PASSES = ("label_errors", "score_images", "training_val")
BASELINE = "imports"  # the interpreter with every module a pass imports and the tiny model, no pass: the floor
MODES = ("whole", "streamed")


def rss_anon_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


def child(name: str, mode: str, shards: Path, batch_size: int) -> None:
    """One pass in this process; prints its seconds and peak RssAnon (MB) as one JSON line."""
    import numpy as np

    from tasks import evaluate
    from tasks.core.params import EvaluateParams
    from tasks.images.shards import SPLITS, ShardSplit, load_manifest
    from tasks.release.inference import OnnxModel
    from tasks.release.scoring import score_images
    from tasks.training.distributed import World
    from tasks.training.loop import validate
    from tasks.training.models import predict_logits
    from tasks.training.temperature import calibrate
    from tests.helpers.shard_dirs import spec_of, tiny_net

    spec = spec_of(shards)
    model = tiny_net(len(spec.class_names))
    peak, done = [rss_anon_kb()], threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            peak[0] = max(peak[0], rss_anon_kb())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    if name == "label_errors":
        params = EvaluateParams(batch_size=batch_size)
        scored: dict[str, np.ndarray] = {}
        if mode == "whole":  # the code before: predict_logits(model, ShardSplit.open(...).all_images(), ...)
            for split in SPLITS:
                scored[split] = predict_logits(model, ShardSplit.open(shards, split).all_images(), spec, batch_size)
        out = shards.parent / f"label_errors.{mode}.json"
        evaluate._label_errors(
            model, spec, shards, scored, params, None, shards.parent / "train_dynamics.json", out, 1.0
        )  # T: the tiny model has none
    elif name == "score_images":
        onnx = OnnxModel.load(shards.parent / "model.onnx")
        if mode == "whole":  # the code before: model.logits(data.all_images(), batch_size), then the manifest
            data = ShardSplit.open(shards, "test")
            onnx.logits(data.all_images(), batch_size).argmax(axis=1)
            load_manifest(shards)
        else:
            score_images(onnx, shards, "test", batch_size)
    elif name == "training_val":
        val = ShardSplit.open(shards, "val")
        images = val.all_images() if mode == "whole" else val  # Start.data held val.all_images() for the whole run
        validate(model, images, val.labels, spec, World())
        calibrate(model, images, val.labels, spec, enabled=True)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    peak[0] = max(peak[0], rss_anon_kb())
    print(json.dumps({"seconds": round(seconds, 2), "heap_mb": round(peak[0] / 1024)}))


def measure(name: str, mode: str, shards: Path, batch_size: int) -> dict[str, Any]:
    """Run one pass in a fresh interpreter: its own figures and the kernel's peak RSS for that process."""
    command = [sys.executable, __file__, "--child", name, "--mode", mode, "--shards", str(shards),
               "--batch-size", str(batch_size)]  # fmt: skip
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{name} {mode} failed (exit {proc.returncode})")
    return {"pass": name, "mode": mode, **json.loads(output.splitlines()[-1]), "rss_mb": usage.ru_maxrss // 1024}


def write(shards: Path, images: int, size: int, classes: int) -> None:
    from tests.helpers.shard_dirs import tiny_onnx, write_dynamics, write_shard_dir

    counts = {"train": images - 2 * (images // 10), "val": images // 10, "test": images // 10}
    rows = max(1, (64 << 20) // (3 * size * size))  # 64 MB shards: 445 images of 224 px
    spec = write_shard_dir(shards, counts, image_size=size, classes=classes, shard_rows=rows)
    write_dynamics(shards.parent / "train_dynamics.json", counts["train"])
    tiny_onnx(shards.parent / "model.onnx", spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=40_000, help="images in all (train/val/test 80/10/10)")
    parser.add_argument("--size", type=int, default=224, help="image side in pixels")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=256, help="evaluate.batch_size and score_images' batch")
    parser.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    parser.add_argument("--shards", type=Path, help="measure shards an earlier run kept (--keep) instead of writing")
    parser.add_argument("--keep", type=Path, help="write the shards under this folder and keep them")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--child", choices=(*PASSES, BASELINE), help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=(*MODES, "-"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.mode, args.shards, args.batch_size)
        return
    scratch = None if args.shards or args.keep else Path(tempfile.mkdtemp(prefix="bench-memory-"))
    try:
        shards = args.shards or (args.keep or scratch) / "shards"
        if not args.shards:
            started = time.perf_counter()
            write(shards, args.images, args.size, args.classes)
            print(f"wrote {shards} in {time.perf_counter() - started:.0f} s", flush=True)
        rows = report(shards, args)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


def report(shards: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    from tasks.images.shards import SPLITS, ShardSplit, load_manifest

    manifest = load_manifest(shards)
    size = manifest["image_size"]
    counts = {split: len(ShardSplit.open(shards, split, verify=False)) for split in SPLITS}
    split_mb = {split: count * 3 * size * size / 2**20 for split, count in counts.items()}
    on_disk = sum(p.stat().st_size for p in shards.glob("*.arrow")) / 2**30
    print(f"{sum(counts.values())} images of {size} px ({', '.join(f'{s} {n}' for s, n in counts.items())}), "
          f"{on_disk:.2f} GB of shards; batch {args.batch_size}; {os.cpu_count()} cores")  # fmt: skip
    print("  " + " ".join([sys.executable, "bench/bench_memory.py", *sys.argv[1:]]))
    largest = {"label_errors": "train", "score_images": "test", "training_val": "val"}
    print(f"{'pass':<13} {'mode':<9} | {'split (all_images)':>18} | {'peak RSS':>9} | {'peak heap':>9} | {'s':>6}")
    floor = measure(BASELINE, "-", shards, args.batch_size)
    rows = [floor]
    print(f"{BASELINE:<13} {'-':<9} | {'-':>18} | {floor['rss_mb']:>6} MB | {floor['heap_mb']:>6} MB |", flush=True)
    for name in args.passes:
        for mode in MODES:
            row = {**measure(name, mode, shards, args.batch_size), "split_mb": round(split_mb[largest[name]])}
            rows.append(row)
            print(f"{name:<13} {mode:<9} | {largest[name]:>7} {row['split_mb']:>7} MB | {row['rss_mb']:>6} MB | "
                  f"{row['heap_mb']:>6} MB | {row['seconds']:>6.1f}", flush=True)  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
