"""The load generator of bench/bench_serving.py: a real uvicorn per server configuration, /predict requests at
each concurrency from an aiohttp client in this process (multipart and raw body), one request at a time in
turns with a bare onnxruntime session, and the bare session's own floor without HTTP."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import psutil

from bench.serving_inputs import FORM, multipart
from tasks.images.imaging import load_array
from tasks.release.inference import OnnxModel, softmax

ROOT = Path(__file__).resolve().parents[1]

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
