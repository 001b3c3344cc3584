"""Load test of the serving app on 127.0.0.1: server configurations side by side, against bare onnxruntime.

    .venv/bin/python bench/bench_serving.py                          # untrained resnet18, 64x64, 10 classes
    .venv/bin/python bench/bench_serving.py --server-python .venv-serve/bin/python   # the lean serving venv
    .venv/bin/python bench/bench_serving.py --onnx models/model.onnx --export-report reports/export.json
    .venv/bin/python bench/bench_serving.py --workers 1 2     # python -m serving at serve.workers 1 and 2

For each configuration (`name:streams,threads,max_batch`; default "one stream" = 1,1,1, the server as it
was before streams and batching, and "default" = params.yaml's serve section) a real uvicorn is
started: time from process start to /ready 200 and RSS once ready are printed. Then JPEG uploads
are POSTed to /predict at each concurrency, both ways: as multipart (field `file`) and as the raw
body (Content-Type image/jpeg), from an aiohttp client in this process (it shares the cores with the
server); the server's /metrics give the mean images per onnxruntime call. Last, the drift
bookkeeping of one prediction (the per-class counter and the window's update) is timed alone and
set against a c=8 request's server CPU time.

With --workers, `python -m serving` runs at each serve.workers instead (bench/serving_workers.py): c=8
throughput, server CPU per request over all its processes, /metrics' count, and the drift window's add in
this process's memory against a file every worker maps.

Beside them, the same uploads without HTTP, in this process: decode + resize + normalise + run on
one onnxruntime session, (a) one after another with one thread (the latency floor of one request)
and (b) from as many threads as the configuration has streams (the throughput floor with the
same total threads). Every ratio is between numbers of this one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serving_inputs import images, untrained_model  # noqa: E402
from bench.serving_load import ROUTES, Config, bare, run_server  # noqa: E402
from bench.serving_workers import report_workers  # noqa: E402
from serving.app import stream_count  # noqa: E402
from serving.monitoring import Metrics  # noqa: E402
from tasks.core.params import DriftParams, ServeParams  # noqa: E402
from tasks.release.drift import DriftWindow  # noqa: E402
from tasks.release.drift_reference import Reference, build_reference, reference_json, top1_and_margin  # noqa: E402
from tasks.release.drift_thresholds import DriftThresholds  # noqa: E402
from tasks.release.inference import OnnxModel, softmax  # noqa: E402


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
    parser.add_argument("--workers", type=int, nargs="+", help="run python -m serving at these serve.workers")
    args = parser.parse_args()
    data = images(50)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        onnx, report = (args.onnx, args.export_report) if args.onnx else untrained_model(tmp, args.size)
        # low_confidence 0: an untrained model is unsure of everything, and the review folder is not under test.
        serve = {"low_confidence": 0.0, "review_dir": str(tmp / "review"), "max_body_bytes": 10 * 2**20}
        paths = {"onnx": str(onnx), "reports": str(report.parent), "baseline": str(tmp / "no-baseline")}
        if args.workers:
            report_workers(args, serve, {**paths, "reports": str(report.parent)}, data, tmp, onnx)
            return
        print(f"model {onnx.name}, {args.requests} requests per level, {os.cpu_count()} cores, server python "
              f"{args.server_python}, load average {os.getloadavg()[0]:.2f}")  # fmt: skip
        servers = {config: run_server(args, config, serve, paths, data) for config in args.config}
        floor = bare(onnx, data, 1, 1, args.requests)
        same = {(n, t): bare(onnx, data, t, n, args.requests) for n, t in {(c.streams, c.threads) for c in args.config}}
        cost = drift_cost_us(OnnxModel.load(onnx))  # while the temporary folder (an untrained model's) still exists
    print_report(args, servers, floor, same, cost)


def print_report(
    args: argparse.Namespace, servers: dict[Config, dict], floor: dict, same: dict[tuple[int, int], dict], cost: float
) -> None:
    """The table (each configuration, route and concurrency beside the bare floors), each server's start-up and
    one-at-a-time line with the ratios, and the drift bookkeeping's share of a c=8 request's server CPU."""
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
    last = servers[args.config[-1]]["levels"]
    at8 = [(c, route) for c, route in last if c == 8]
    for key in at8:
        server_ms = last[key]["server_cpu_ms"]
        print(f"drift bookkeeping: {cost:.1f} us per prediction, {cost / 10 / server_ms:.2f}% of a {key[1]} c=8 "
              f"request's server CPU ({server_ms:.2f} ms) in '{args.config[-1].name}'")  # fmt: skip


if __name__ == "__main__":
    main()
