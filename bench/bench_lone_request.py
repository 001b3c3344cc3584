"""Where a lone raw-body POST /predict spends its time, against bare onnxruntime, on 127.0.0.1.

    .venv/bin/python bench/bench_lone_request.py --onnx models/model.onnx --export-report reports/export.json

Two uvicorn servers from the serving venv: the app as `make serve` runs it, and the same app's Batcher
and Classifier behind a minimal ASGI handler (no middleware, no routing, no FastAPI: the floor of
what a framework change could reach). One request at a time to each, raw JPEG bodies, in alternating
blocks of 50 with a bare session in this process (decode + onnxruntime + softmax), so load drifts
slow all three alike. Then the served app's request split into phases by timestamps taken on both
sides (CLOCK_MONOTONIC is shared by the processes): client send -> the ASGI app entered -> the
inference call started -> it ended -> the app returned -> the client has the answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serving_inputs import images, untrained_model  # noqa: E402
from bench.serving_load import free_port, wait_ready  # noqa: E402
from tasks.images.imaging import load_array  # noqa: E402
from tasks.release.inference import OnnxModel, softmax  # noqa: E402

SERVER = """
import json, os, signal, sys, time, uvicorn
import serving.app as A
from tasks.core.params import Paths, ServeParams
events, batchers = [], []
class Recorded(A.Batcher):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        batchers.append(self)
A.Batcher = Recorded
call = A.Classifier.__call__
def timed(self, jobs):
    start = time.perf_counter()
    try:
        return call(self, jobs)
    finally:
        events.append(("call", start, time.perf_counter()))
A.Classifier.__call__ = timed
served = A.create_app(ServeParams(**json.loads(sys.argv[1])), Paths(**json.loads(sys.argv[2])))
minimal = sys.argv[4] == "minimal"
async def app(scope, receive, send):
    start = time.perf_counter()
    if minimal and scope["type"] == "http" and scope["path"] == "/predict":
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        answer = await batchers[0].submit([("body", body)])
        data = json.dumps({"model": served.state.serving.info, "prediction": answer[0]}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": data})
    else:
        await served(scope, receive, send)
    events.append(("app", start, time.perf_counter()))
def dump(*_):
    print(json.dumps(events), flush=True)
    os._exit(0)
signal.signal(signal.SIGTERM, dump)
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[3]), log_level="warning", lifespan="on")
"""

PHASES = ("client -> app", "app -> inference", "inference", "inference -> app returns", "app -> client", "total")


def start(python: str, serve: dict, paths: dict, kind: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([python, "-c", SERVER, json.dumps(serve), json.dumps(paths), str(port), kind], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, time.perf_counter(), kind)
    return proc, url


async def in_turns(urls: dict[str, str], model: OnnxModel, data: list[bytes], blocks: int) -> dict[str, list]:
    """(send, done) times of each request to each server, and bare seconds; the first block is warm-up."""
    sent: dict[str, list] = {name: [] for name in (*urls, "bare")}
    async with aiohttp.ClientSession() as session:
        for block in range(blocks + 1):
            for name, url in urls.items():
                for i in range(50):
                    begin = time.perf_counter()
                    async with session.post(f"{url}/predict", data=data[i % len(data)],
                                            headers={"Content-Type": "image/jpeg"}) as response:  # fmt: skip
                        await response.read()
                        assert response.status == 200, await response.text()
                    if block:
                        sent[name].append((begin, time.perf_counter()))
            for i in range(50):
                begin = time.perf_counter()
                softmax(model.logits(load_array(data[i % len(data)], model.spec)[None]))
                if block:
                    sent["bare"].append((begin, time.perf_counter()))
    return sent


def phases(requests: list[tuple[float, float]], events: list) -> dict[str, float]:
    """Median ms of each phase, from the client's (send, done) and the server's app and inference spans."""
    apps = sorted((a, b) for kind, a, b in events if kind == "app")
    calls = sorted((a, b) for kind, a, b in events if kind == "call")
    found: dict[str, list[float]] = {name: [] for name in PHASES}
    for send, done in requests:
        app = [(a, b) for a, b in apps if send <= a <= done]
        call = [(a, b) for a, b in calls if send <= a <= done]
        if len(app) != 1 or len(call) != 1:
            continue
        (a0, a1), (c0, c1) = app[0], call[0]
        for name, seconds in zip(PHASES, (a0 - send, c0 - a0, c1 - c0, a1 - c1, done - a1, done - send), strict=True):
            found[name].append(seconds)
    return {name: float(np.median(values)) * 1000 for name, values in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--onnx", type=Path, help="a model.onnx (default: an untrained resnet18 at 64x64)")
    parser.add_argument("--export-report", type=Path, help="the export.json holding --onnx's onnx_sha256")
    parser.add_argument("--blocks", type=int, default=8, help="blocks of 50 requests per server")
    parser.add_argument("--server-python", default=str(ROOT / ".venv-serve" / "bin" / "python"))
    args = parser.parse_args()
    data = images(50)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        onnx, report = (args.onnx, args.export_report) if args.onnx else untrained_model(tmp, 64)
        serve = {"streams": 2, "threads": 1, "low_confidence": 0.0, "review_dir": str(tmp / "review")}
        paths = {"onnx": str(onnx), "reports": str(report.parent), "baseline": str(tmp / "no-baseline")}
        servers = {kind: start(args.server_python, serve, paths, kind) for kind in ("served", "minimal")}
        try:
            sent = asyncio.run(in_turns({k: url for k, (_, url) in servers.items()}, OnnxModel.load(onnx, threads=1),
                                        data, args.blocks))  # fmt: skip
        finally:
            events = {}
            for kind, (proc, _) in servers.items():
                proc.terminate()
                events[kind] = json.loads(proc.communicate(timeout=30)[0].strip().splitlines()[-1])
    p50 = {name: float(np.median([b - a for a, b in times])) * 1000 for name, times in sent.items()}
    print(f"{args.blocks * 50} lone raw-body requests per server, in turns with bare onnxruntime (1 thread):")
    labels = {"served": "the app as served", "minimal": "minimal ASGI handler", "bare": "bare onnxruntime"}
    for name, ms in p50.items():
        print(f"  {labels[name]:22} p50 {ms:6.2f} ms  {ms / p50['bare']:.2f}x bare")
    print("the app as served, by phase (p50 ms):")
    for name, ms in phases(sent["served"], events["served"]).items():
        print(f"  {name:26} {ms:6.3f}")


if __name__ == "__main__":
    main()
