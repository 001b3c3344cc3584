"""Load test of the serving app on 127.0.0.1: server configurations side by side, against bare onnxruntime.

    .venv/bin/python bench/bench_serving.py                          # untrained resnet18, 64x64, 10 classes
    .venv/bin/python bench/bench_serving.py --server-python .venv-serve/bin/python   # the lean serving venv
    .venv/bin/python bench/bench_serving.py --onnx models/model.onnx --export-report reports/export.json

For each configuration (`name:streams,threads,max_batch`; default "one stream" = 1,1,1, the server as it
was before streams and batching, and "default" = params.yaml's serve section) a real uvicorn is
started: time from process start to /ready 200 and RSS once ready are printed. Then JPEG uploads
are POSTed to /predict at each concurrency, both ways: as multipart (field `file`) and as the raw
body (Content-Type image/jpeg), from an aiohttp client in this process (it shares the cores with the
server); the server's /metrics give the mean images per onnxruntime call. Last, the drift
bookkeeping of one prediction (the per-class counter and the window's update) is timed alone and
set against a c=8 request's server CPU time.

Beside them, the same uploads without HTTP, in this process: decode + resize + normalise + run on
one onnxruntime session, (a) one after another with one thread (the latency floor of one request)
and (b) from as many threads as the configuration has streams (the throughput floor with the
same total threads). Every ratio is between numbers of this one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serving_inputs import FORM, images, multipart, untrained_model  # noqa: E402
from serving.app import stream_count  # noqa: E402
from serving.monitoring import Metrics  # noqa: E402
from tasks.core.params import DriftParams, ServeParams  # noqa: E402
from tasks.images.imaging import load_array  # noqa: E402
from tasks.release.drift import (  # noqa: E402
    DriftThresholds,
    DriftWindow,
    Reference,
    build_reference,
    reference_json,
    top1_and_margin,
)  # noqa: E402
from tasks.release.inference import OnnxModel, softmax  # noqa: E402

SERVER = """
import json, sys, uvicorn
from serving.app import create_app
from tasks.core.params import Paths, ServeParams
app = create_app(ServeParams(**json.loads(sys.argv[1])), Paths(**json.loads(sys.argv[2])))
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[3]), log_level="warning")
"""


@dataclass(frozen=True)
class Config:
    name: str
    streams: int
    threads: int
    max_batch: int

    @classmethod
    def parse(cls, text: str) -> Config:
        name, _, numbers = text.partition(":")
        streams, threads, max_batch = (int(n) for n in numbers.split(","))
        return cls(name, streams, threads, max_batch)


def summary(seconds: list[float], wall: float, errors: int = 0) -> dict[str, float]:
    ms = np.array(seconds) * 1000
    return {"rps": len(seconds) / wall, "p50": float(np.percentile(ms, 50)), "p95": float(np.percentile(ms, 95)),
            "p99": float(np.percentile(ms, 99)), "errors": errors}  # fmt: skip


RAW = {"Content-Type": "image/jpeg"}
ROUTES = ("multipart", "raw")


def bodies_of(route: str, data: list[bytes]) -> tuple[list[bytes], dict[str, str]]:
    """The request bodies (encoded up front) and headers of one way of sending an image."""
    if route == "raw":
        return data, RAW
    return [multipart(f"{i}.jpg", item) for i, item in enumerate(data)], FORM


async def load(url: str, data: list[bytes], concurrency: int, requests: int, route: str) -> dict[str, float]:
    bodies, headers = bodies_of(route, data)
    latencies: list[float] = []
    errors = 0
    queue = iter(range(2 * concurrency))  # a warm-up round first: connections open, the server's pools settle

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal errors
        for i in queue:
            start = time.perf_counter()
            try:
                async with session.post(f"{url}/predict", data=bodies[i % len(bodies)], headers=headers) as response:
                    await response.read()
                    ok = response.status == 200
            except aiohttp.ClientError:
                ok = False
            latencies.append(time.perf_counter() - start)
            errors += not ok

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        queue, errors = iter(range(requests)), 0
        latencies.clear()
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return summary(latencies, wall, errors)


async def in_turns(url: str, model: OnnxModel, data: list[bytes], requests: int, block: int = 50) -> dict[str, float]:
    """p50 ms of one request at a time through the server (each route), and of the same uploads on a bare
    session in this process, measured in alternating blocks of `block` so that drifts in the machine's
    load slow all alike (blocks, not single turns: each side keeps its caches warm, as it does alone)."""
    times: dict[str, list[float]] = {name: [] for name in (*ROUTES, "bare")}
    sent = {route: bodies_of(route, data) for route in ROUTES}
    async with aiohttp.ClientSession() as session:
        for first in range(0, requests, block):
            for route, (bodies, headers) in sent.items():
                for i in range(first, first + block):
                    start = time.perf_counter()
                    async with session.post(f"{url}/predict", data=bodies[i % len(bodies)], headers=headers) as r:
                        await r.read()
                    if r.status == 200:
                        times[route].append(time.perf_counter() - start)
            for i in range(first, first + block):
                start = time.perf_counter()
                softmax(model.logits(load_array(data[i % len(data)], model.spec)[None]))
                times["bare"].append(time.perf_counter() - start)
    return {name: float(np.median(values)) * 1000 for name, values in times.items()}


def bare(onnx: Path, data: list[bytes], threads: int, parallel: int, requests: int) -> dict[str, float]:
    """Decode + run per upload on one session, from `parallel` threads at once, no HTTP."""
    model = OnnxModel.load(onnx, threads=threads)
    for item in data[:3]:
        model.logits(load_array(item, model.spec)[None])
    latencies: list[float] = []
    queue = iter(range(requests))

    def worker() -> None:
        for i in queue:
            start = time.perf_counter()
            softmax(model.logits(load_array(data[i % len(data)], model.spec)[None]))
            latencies.append(time.perf_counter() - start)

    pool = [threading.Thread(target=worker) for _ in range(parallel)]
    me = psutil.Process()
    cpu, start = sum(me.cpu_times()[:2]), time.perf_counter()
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    result = summary(latencies, time.perf_counter() - start)
    return result | {"cpu_ms": (sum(me.cpu_times()[:2]) - cpu) * 1000 / requests}


def batches(url: str) -> tuple[float, float]:
    """(calls, images) so far from the server's serve_batch_size histogram."""
    text = asyncio.run(_get(f"{url}/metrics"))
    found = {k: float(v) for k, v in re.findall(r"^serve_batch_size_(count|sum) (\S+)$", text, re.M)}
    return found.get("count", 0.0), found.get("sum", 0.0)


async def _get(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return await response.text()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_server(args: argparse.Namespace, config: Config, serve: dict, paths: dict, data: list[bytes]) -> dict:
    port = free_port()
    serve = {**serve, "streams": config.streams, "threads": config.threads, "max_batch": config.max_batch}
    env = {**os.environ, "OMP_NUM_THREADS": str(config.threads)}
    started = time.perf_counter()
    server = subprocess.Popen([args.server_python, "-c", SERVER, json.dumps(serve), json.dumps(paths), str(port)],
                              cwd=ROOT, env=env)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        ready_s = wait_ready(url, server, started, config.name)
        rss_ready = psutil.Process(server.pid).memory_info().rss / 2**20
        solo = OnnxModel.load(paths["onnx"], threads=config.threads)
        c1 = asyncio.run(in_turns(url, solo, data, args.requests))
        levels = {}
        proc, me = psutil.Process(server.pid), psutil.Process()
        cpu = lambda p: sum(p.cpu_times()[:2])  # noqa: E731 - user + system seconds
        for c in args.concurrency:
            for route in ROUTES:
                calls, images_before = batches(url)
                server_cpu, client_cpu = cpu(proc), cpu(me)
                level = asyncio.run(load(url, data, c, args.requests, route))
                level["server_cpu_ms"] = (cpu(proc) - server_cpu) * 1000 / args.requests
                level["client_cpu_ms"] = (cpu(me) - client_cpu) * 1000 / args.requests
                calls_after, images_after = batches(url)
                level["batch"] = (images_after - images_before) / max(1.0, calls_after - calls)
                levels[(c, route)] = level
        rss = psutil.Process(server.pid).memory_info().rss / 2**20
    finally:
        server.terminate()
        server.wait(timeout=30)
    return {"levels": levels, "ready_s": ready_s, "rss_ready": rss_ready, "rss": rss, "c1": c1}


def drift_cost_us(model: OnnxModel, repeats: int = 20000) -> float:
    """Microseconds of the drift bookkeeping of one prediction: the per-class counter and the window's add
    (bin search, counts, the three PSIs), with a reference as export makes one and a full window."""
    rng = np.random.default_rng(0)
    names = model.class_names
    logits = rng.normal(size=(2000, len(names))) * 4
    probs = softmax(logits)
    meta = {"drift_reference": reference_json(build_reference(probs[:1000], names, sizes=(200, 500)))}
    reference = Reference.from_metadata(meta, names, "bench")
    window = DriftWindow(names, reference, DriftThresholds.resolve(DriftParams(), reference)[0])
    counter = Metrics().predicted_class
    top1, margin = top1_and_margin(probs)
    rows = list(zip(probs.argmax(axis=1).tolist(), top1.tolist(), margin.tolist(), strict=True))
    for index, top1, margin in rows[:600]:  # the window full, past min_predictions
        window.add(index, top1, margin)
    start = time.perf_counter()
    for i in range(repeats):
        index, top1, margin = rows[i % len(rows)]
        counter.labels(label=names[index]).inc()
        window.add(index, top1, margin)
    return (time.perf_counter() - start) / repeats * 1e6


def wait_ready(url: str, server: subprocess.Popen, started: float, name: str) -> float:
    """Seconds from `started` until the server's /ready says 200; SystemExit when it dies or takes 60 s."""
    while True:
        try:
            if asyncio.run(_status(f"{url}/ready")) == 200:
                return time.perf_counter() - started
        except aiohttp.ClientError:
            pass
        if server.poll() is not None or time.perf_counter() - started > 60:
            raise SystemExit(f"{name}: server not ready within 60 s")
        time.sleep(0.05)


async def _status(url: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
        return r.status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--onnx", type=Path, help="a model.onnx (default: an untrained resnet18)")
    parser.add_argument("--export-report", type=Path, help="the export.json holding --onnx's onnx_sha256")
    parser.add_argument("--size", type=int, default=64, help="input size when no --onnx is given")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=400, help="requests per concurrency level")
    parser.add_argument("--server-python", default=sys.executable, help="the interpreter that runs the server")
    serve = ServeParams()
    default = Config("default", stream_count(serve), serve.threads, serve.max_batch)
    parser.add_argument("--config", type=Config.parse, nargs="+", metavar="NAME:STREAMS,THREADS,MAX_BATCH",
                        default=[Config("one stream", 1, 1, 1), default])  # fmt: skip
    args = parser.parse_args()
    data = images(50)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        onnx, report = (args.onnx, args.export_report) if args.onnx else untrained_model(tmp, args.size)
        # low_confidence 0: an untrained model is unsure of everything, and the review folder is not under test.
        serve = {"low_confidence": 0.0, "review_dir": str(tmp / "review"), "max_body_bytes": 10 * 2**20}
        paths = {"onnx": str(onnx), "reports": str(report.parent), "baseline": str(tmp / "no-baseline")}
        print(f"model {onnx.name}, {args.requests} requests per level, {os.cpu_count()} cores, server python "
              f"{args.server_python}, load average {os.getloadavg()[0]:.2f}")  # fmt: skip
        servers = {config: run_server(args, config, serve, paths, data) for config in args.config}
        floor = bare(onnx, data, 1, 1, args.requests)
        onnx_path = onnx
        same = {(n, t): bare(onnx, data, t, n, args.requests) for n, t in {(c.streams, c.threads) for c in args.config}}
    header = f"{'':34} {'req/s':>7} {'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7} {'errors':>6} {'img/call':>8} "
    header += "CPU ms/request: server client"
    print(header)
    for config, result in servers.items():
        for (c, route), r in result["levels"].items():
            name = f"{config.name} ({config.streams}x{config.threads}t, batch<={config.max_batch}) {route} c={c}"
            print(f"{name:34} {r['rps']:7.1f} {r['p50']:7.2f} {r['p95']:7.2f} {r['p99']:7.2f} {r['errors']:6d} "
                  f"{r['batch']:8.2f} {r['server_cpu_ms']:21.2f} {r['client_cpu_ms']:6.2f}")  # fmt: skip
    rows = {"bare, 1 thread, one at a time": floor}
    rows |= {f"bare, {n} calls at once x {t}t": r for (n, t), r in same.items() if (n, t) != (1, 1)}
    for name, r in rows.items():
        print(f"{name:34} {r['rps']:7.1f} {r['p50']:7.2f} {r['p95']:7.2f} {r['p99']:7.2f} {0:6d} {1:8.2f} "
              f"{r['cpu_ms']:21.2f}")  # fmt: skip
    print()
    first, *rest = servers
    for config in servers:
        result = servers[config]
        line = f"{config.name}: ready {result['ready_s']:.2f} s after start, RSS {result['rss_ready']:.0f} MiB ready, "
        line += f"{result['rss']:.0f} MiB after the run"
        c1 = result["c1"]
        line += f"; one at a time, in turns with a bare session ({config.threads}t): p50 bare {c1['bare']:.2f} ms"
        line += "".join(f", {route} {c1[route]:.2f} ms ({c1[route] / c1['bare']:.2f}x)" for route in ROUTES)
        print(line)
        levels = result["levels"]
        for c, route in [(c, route) for c, route in levels if c >= config.streams]:
            bare_same = (
                floor if (config.streams, config.threads) == (1, 1) else same[(config.streams, config.threads)]
            )["rps"]
            ratio = f"{route} c={c}: {levels[(c, route)]['rps'] / bare_same:.2f}x bare with the same threads"
            if config in rest:
                ratio += (
                    f", {levels[(c, route)]['rps'] / servers[first]['levels'][(c, route)]['rps']:.2f}x '{first.name}'"
                )
            print(f"  {ratio}")
    cost = drift_cost_us(OnnxModel.load(onnx_path))
    last = servers[args.config[-1]]["levels"]
    at8 = [(c, route) for c, route in last if c == 8]
    for key in at8:
        server_ms = last[key]["server_cpu_ms"]
        print(f"drift bookkeeping: {cost:.1f} us per prediction, {cost / 10 / server_ms:.2f}% of a {key[1]} c=8 "
              f"request's server CPU ({server_ms:.2f} ms) in '{args.config[-1].name}'")  # fmt: skip


if __name__ == "__main__":
    main()
