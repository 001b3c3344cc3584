"""Load test of the serving app on 127.0.0.1 at several concurrencies, vs a bare onnxruntime session.

    .venv/bin/python bench/bench_serving.py                      # untrained resnet18, 64x64, 10 classes
    .venv/bin/python bench/bench_serving.py --onnx models/model.onnx --export-report reports/export.json

Starts a real uvicorn server (one worker, serve.threads onnxruntime threads), POSTs JPEGs to /predict
at each concurrency and prints throughput, p50/p95/p99 latency and errors; then the same images
through one in-process OnnxModel (decode + resize + normalise + run, no HTTP), so the serving
overhead is a ratio measured in the same run. The client shares the machine's cores with the server.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.core.io import sha256_file  # noqa: E402
from tasks.core.paths import Paths  # noqa: E402
from tasks.images.imaging import PreprocessSpec, load_array  # noqa: E402
from tasks.release.inference import OnnxModel  # noqa: E402
from tasks.release.onnx_metadata import write_metadata  # noqa: E402
from tasks.training.models import build_model  # noqa: E402
from tasks.training.serialize import export_onnx  # noqa: E402

SERVER = """
import json, sys, uvicorn
from serving.app import create_app
from tasks.core.params import Paths, ServeParams
app = create_app(ServeParams(**json.loads(sys.argv[1])), Paths(**json.loads(sys.argv[2])))
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[3]), log_level="warning")
"""


def untrained_model(tmp: Path, size: int) -> tuple[Path, Path]:
    torch.manual_seed(0)
    spec = PreprocessSpec(image_size=size, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
                          class_names=tuple(f"c{i}" for i in range(10)))  # fmt: skip
    onnx = tmp / "models" / "model.onnx"
    onnx.parent.mkdir(parents=True)
    export_onnx(build_model("resnet18", 10).eval(), spec, onnx, opset=18)
    write_metadata(onnx, {"preprocess_spec": spec.model_dump_json()})
    report = Paths(reports=tmp / "reports").export_report
    report.parent.mkdir(parents=True)
    report.write_text(json.dumps({"onnx_sha256": sha256_file(onnx)}))
    return onnx, report


def images(count: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        h, w = rng.integers(64, 257, size=2)
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


async def load(url: str, data: list[bytes], concurrency: int, requests: int) -> dict[str, float]:
    latencies: list[float] = []
    errors = 0
    queue = iter(range(requests))

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal errors
        for i in queue:
            start = time.perf_counter()
            try:
                response = await client.post(f"{url}/predict", files={"file": (f"{i}.jpg", data[i % len(data)])})
                ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            latencies.append(time.perf_counter() - start)
            errors += not ok

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ms = np.array(latencies) * 1000
    return {"rps": requests / wall, "p50": float(np.percentile(ms, 50)), "p95": float(np.percentile(ms, 95)),
            "p99": float(np.percentile(ms, 99)), "errors": errors}  # fmt: skip


def bare(onnx: Path, data: list[bytes], threads: int, requests: int) -> dict[str, float]:
    model = OnnxModel.load(onnx, threads=threads)
    for item in data[:3]:
        model.logits(load_array(item, model.spec)[None])
    ms = []
    start = time.perf_counter()
    for i in range(requests):
        t = time.perf_counter()
        logits = model.logits(load_array(data[i % len(data)], model.spec)[None])[0].astype(np.float64)
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        ms.append((time.perf_counter() - t) * 1000)
    wall = time.perf_counter() - start
    return {"rps": requests / wall, "p50": float(np.percentile(ms, 50)), "p95": float(np.percentile(ms, 95)),
            "p99": float(np.percentile(ms, 99)), "errors": 0}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--onnx", type=Path, help="a model.onnx (default: an untrained resnet18)")
    parser.add_argument("--export-report", type=Path, help="the export.json holding --onnx's onnx_sha256")
    parser.add_argument("--size", type=int, default=64, help="input size when no --onnx is given")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=300, help="requests per concurrency level")
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime threads (server and bare)")
    args = parser.parse_args()
    data = images(50)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        onnx, report = (args.onnx, args.export_report) if args.onnx else untrained_model(tmp, args.size)
        # low_confidence 0: an untrained model is unsure of everything, and the review folder is not under test.
        serve = {"threads": args.threads, "low_confidence": 0.0, "review_dir": str(tmp / "review"),
                 "max_body_bytes": 10 * 2**20}  # fmt: skip
        paths = {"onnx": str(onnx), "reports": str(report.parent), "baseline": str(tmp / "no-baseline")}
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        server = subprocess.Popen([sys.executable, "-c", SERVER, json.dumps(serve), json.dumps(paths), str(port)],
                                  env=env)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(300):
                try:
                    if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            else:
                raise SystemExit("server not ready within 60 s")
            rss_ready = psutil.Process(server.pid).memory_info().rss / 2**20
            print(f"model {onnx.name}, {args.requests} requests per level, onnxruntime threads {args.threads}, "
                  f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")  # fmt: skip
            results = {f"server c={c}": asyncio.run(load(url, data, c, args.requests)) for c in args.concurrency}
            results["bare onnxruntime, 1 process"] = bare(onnx, data, args.threads, args.requests)
            rss = psutil.Process(server.pid).memory_info().rss / 2**20
        finally:
            server.terminate()
            server.wait(timeout=30)
    base = results["bare onnxruntime, 1 process"]
    print(f"{'':28} {'req/s':>8} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'errors':>6} {'bare/this rps':>14}")
    for name, r in results.items():
        print(f"{name:28} {r['rps']:8.1f} {r['p50']:8.2f} {r['p95']:8.2f} {r['p99']:8.2f} {r['errors']:6d} "
              f"{base['rps'] / r['rps']:14.2f}")  # fmt: skip
    c1 = results.get("server c=1")
    if c1:
        print(f"serving overhead at concurrency 1: p50 {c1['p50'] / base['p50']:.2f}x the bare session's")
    print(f"server RSS: {rss_ready:.0f} MiB when ready, {rss:.0f} MiB after the run")


if __name__ == "__main__":
    main()
