"""bench_serving.py --workers: `python -m serving` at several serve.workers, as `make serve` runs it.

Each server runs in a project folder of its own (params.yaml: serve + paths), with every uvicorn worker sharing
the drift window, the review count and the Prometheus files (serving/shared_memory.py). Printed per worker
count: requests per second at c=8 (raw body), the server's CPU per request over all its processes, and whether
/metrics counted every prediction. Beside them, the drift bookkeeping of one prediction with the window in this
process's memory and in a shared file (the file lock included).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import yaml

from bench.serving_load import free_port, load, wait_ready
from serving.shared_memory import SharedFile
from tasks.core.params import DriftParams
from tasks.release.drift import DriftWindow
from tasks.release.drift_reference import Reference, build_reference, reference_json, top1_and_margin
from tasks.release.drift_thresholds import DriftThresholds
from tasks.release.inference import OnnxModel, softmax
from tasks.release.window_memory import LocalMemory, WindowMemory

ROOT = Path(__file__).resolve().parents[1]
CONCURRENCY = 8


def window_add_us(model: OnnxModel, memory: WindowMemory, repeats: int = 20000) -> float:
    """Microseconds per DriftWindow.add with a full window, a reference as export makes one, in `memory`."""
    names = model.class_names
    probs = softmax(np.random.default_rng(0).normal(size=(2000, len(names))) * 4)
    meta = {"drift_reference": reference_json(build_reference(probs[:1000], names, sizes=(200, 500)))}
    reference = Reference.from_metadata(meta, names, "bench")
    window = DriftWindow(names, reference, DriftThresholds.resolve(DriftParams(), reference)[0], memory=memory)
    top1, margin = top1_and_margin(probs)
    rows = list(zip(probs.argmax(axis=1).tolist(), top1.tolist(), margin.tolist(), strict=True))
    for index, t, m in rows[:600]:
        window.add(index, t, m)
    start = time.perf_counter()
    for i in range(repeats):
        window.add(*rows[i % len(rows)])
    return (time.perf_counter() - start) / repeats * 1e6


def _cpu_s(proc: psutil.Process) -> float:
    """User + system seconds of the server and every worker it started."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):  # a worker that exited meanwhile
            total += sum(p.cpu_times()[:2])
    return total


def _predictions(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(r"^serve_predictions_total (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def run_workers(args: argparse.Namespace, workers: int, serve: dict, paths: dict, data: list[bytes], tmp: Path) -> dict:
    """One `python -m serving` at `workers` workers: c=8 throughput, server CPU per request, /metrics' count."""
    project, port = tmp / f"workers-{workers}", free_port()
    project.mkdir()
    settings = {**serve, "host": "127.0.0.1", "port": port, "workers": workers}
    absolute = {key: str(Path(value).resolve()) for key, value in paths.items()}  # the server runs in `project`
    (project / "params.yaml").write_text(yaml.safe_dump({"serve": settings, "paths": {**absolute, "runs": "runs"}}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    server = subprocess.Popen([str(Path(args.server_python).absolute()), "-m", "serving"], cwd=project, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        ready_s = wait_ready(url, server, started, f"workers {workers}")
        asyncio.run(load(url, data, CONCURRENCY, 50, "raw"))  # every worker warm
        proc = psutil.Process(server.pid)
        cpu, before = _cpu_s(proc), _predictions(url)
        level = asyncio.run(load(url, data, CONCURRENCY, args.requests, "raw"))
        sent = args.requests + 2 * CONCURRENCY  # load() sends a warm-up round of 2 x c first
        level["server_cpu_ms"] = (_cpu_s(proc) - cpu) * 1000 / sent
        level["sent"] = sent
        level["counted"] = _predictions(url) - before
    finally:
        server.send_signal(2)
        server.wait(timeout=30)
    return {"ready_s": ready_s, **level}


def report_workers(
    args: argparse.Namespace, serve: dict, paths: dict, data: list[bytes], tmp: Path, onnx: Path
) -> None:
    results = {n: run_workers(args, n, serve, paths, data, tmp) for n in args.workers}
    first = results[args.workers[0]]
    print(f"python -m serving, raw body, c={CONCURRENCY}, {args.requests} requests, {os.cpu_count()} cores")
    for n, r in results.items():
        print(f"workers {n}: {r['rps']:.1f} req/s ({r['rps'] / first['rps']:.2f}x workers {args.workers[0]}), p50 "
              f"{r['p50']:.2f} ms, p99 {r['p99']:.2f} ms, server CPU {r['server_cpu_ms']:.2f} ms/request, ready in "
              f"{r['ready_s']:.1f} s, /metrics counted {r['counted']:.0f} of {r['sent']}")  # fmt: skip
    model = OnnxModel.load(onnx)
    local = window_add_us(model, LocalMemory())
    shared = window_add_us(model, SharedFile(tmp / "bench.window"))
    print(f"drift window add: {local:.1f} us in this process's memory, {shared:.1f} us in a shared file with its "
          f"lock ({shared / local:.2f}x); {shared * 100 / 1000 / first['server_cpu_ms']:.2f}% of a c=8 request's "
          f"server CPU ({first['server_cpu_ms']:.2f} ms) at workers {args.workers[0]}")  # fmt: skip
