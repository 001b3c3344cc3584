"""Peak memory of each stage, whole, on a dataset of about 6 GB of shards (issue 57, part 4; bench_memory.py
measures the passes inside them one by one, against the whole split in RAM).

    .venv/bin/python bench/bench_stage_memory.py                         # 40,000 images of 224 px: 5.6 GB
    .venv/bin/python bench/bench_stage_memory.py --images 2000 --size 64  # a quick look (seconds)
    .venv/bin/python bench/bench_stage_memory.py --shards DIR             # shards bench_memory.py --keep wrote

Synthetic shards (tests/helpers/shard_dirs.py: random pixels, train/val/test 80/10/10, 10 classes). Then each
stage's own function, in a fresh interpreter, in the order the DAG runs them, each on what the one before wrote:
- train: tasks.train.run with params.yaml's train section, except `--arch` (mobilenet_v3_small: a real torchvision
  model whose epoch on 32,000 images of 224 px takes minutes on 2 cores, not an hour) and one epoch;
- evaluate: tasks.evaluate.run (test metrics, the gallery, and the label-error pass over every split);
- export: tasks.export.run (ONNX, INT8, parity and timings on the test split, the drift reference);
- check_regression: tasks.check_regression.run, with no baseline (the candidate scored on the test split).
Peak RSS is the kernel's (wait4's ru_maxrss): it counts the memory-mapped shard pages a stage touched, page cache
the kernel drops under pressure. Peak heap is RssAnon, sampled every 10 ms in the stage's process: the memory a
stage needs. Asserts nothing; prints one table and the command.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file: the project's packages

from bench.bench_memory import rss_anon_kb, write  # noqa: E402

STAGES = ("train", "evaluate", "export", "check_regression")


def child(stage: str, work: Path, arch: str) -> None:
    """One stage in this process, on `work`'s files; prints its seconds and peak RssAnon (MB) as one JSON line."""
    from tasks.core.params import load_params

    p = load_params(ROOT / "params.yaml")
    shards, reports = work / "shards", work / "reports"
    peak, done = [rss_anon_kb()], threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            peak[0] = max(peak[0], rss_anon_kb())

    threading.Thread(target=sample, daemon=True).start()
    start = time.perf_counter()
    if stage == "train":
        from tasks import train

        train.run(p.train.model_copy(update={"arch": arch, "epochs": 1}), seed=p.seed, shard_dir=shards,
                  model_path=work / "model.pt", history_path=reports / "train_history.json",
                  plot_path=reports / "train_curves.png", runs_dir=work / "runs", provenance={},
                  parent_dir=work / "parent")  # fmt: skip
    elif stage == "evaluate":
        from tasks import evaluate

        evaluate.run(p.evaluate, model_path=work / "model.pt", shard_dir=shards, metrics_path=reports / "metrics.json",
                     confusion_json=reports / "confusion.json", confusion_png=reports / "confusion.png",
                     dynamics_path=reports / "train_dynamics.json")  # fmt: skip
    elif stage == "export":
        from tasks import export

        export.run(p.export, seed=p.seed, model_path=work / "model.pt", shard_dir=shards,
                   onnx_path=work / "model.onnx", exports_dir=work / "exports", report_path=reports / "export.json",
                   timings_path=reports / "export_timings.json", drift=p.serve.drift)  # fmt: skip
    elif stage == "check_regression":
        from tasks import check_regression

        (work / "baseline").mkdir(exist_ok=True)
        check_regression.run(p.regression, onnx_path=work / "model.onnx", export_report=reports / "export.json",
                             shard_dir=shards, baseline_dir=work / "baseline", verdict_path=reports / "regression.json",
                             table_path=reports / "regression.md", gate_path=reports / "gate.json")  # fmt: skip
    seconds = time.perf_counter() - start
    done.set()
    peak[0] = max(peak[0], rss_anon_kb())
    print(json.dumps({"seconds": round(seconds, 1), "heap_mb": round(peak[0] / 1024)}))


def measure(stage: str, work: Path, arch: str) -> dict:
    command = [sys.executable, __file__, "--child", stage, "--work", str(work), "--arch", arch]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{stage} failed (exit {os.waitstatus_to_exitcode(status)})")
    return {"stage": stage, **json.loads(output.splitlines()[-1]), "rss_mb": usage.ru_maxrss // 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=40_000, help="images in all (train/val/test 80/10/10)")
    parser.add_argument("--size", type=int, default=224, help="image side in pixels")
    parser.add_argument("--arch", default="mobilenet_v3_small", help="train.arch for the run")
    parser.add_argument("--shards", type=Path, help="a shard directory bench_memory.py --keep wrote (read only)")
    parser.add_argument("--child", choices=STAGES, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.work, args.arch)
        return
    work = Path(tempfile.mkdtemp(prefix="bench-stage-memory-"))
    try:
        (work / "reports").mkdir()
        started = time.perf_counter()
        if args.shards:
            (work / "shards").symlink_to(args.shards.resolve())
        else:
            write(work / "shards", args.images, args.size, 10)
        on_disk = sum(p.stat().st_size for p in (work / "shards").glob("*.arrow")) / 2**30
        print(f"{on_disk:.2f} GB of shards ({time.perf_counter() - started:.0f} s to write); arch {args.arch}; "
              f"{os.cpu_count()} cores", flush=True)  # fmt: skip
        print(f"{'stage':<17} | {'peak RSS':>9} | {'peak heap':>9} | {'s':>6}")
        for stage in STAGES:
            row = measure(stage, work, args.arch)
            print(f"{stage:<17} | {row['rss_mb']:>6} MB | {row['heap_mb']:>6} MB | {row['seconds']:>6.1f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("command: " + " ".join([".venv/bin/python", "bench/bench_stage_memory.py", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
