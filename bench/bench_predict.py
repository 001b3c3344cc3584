"""`make predict` against the server on the same folder, side by side in one run: images per second.

    .venv/bin/python bench/bench_predict.py                      # untrained resnet18, 64x64, 400 JPEGs
    .venv/bin/python bench/bench_predict.py --onnx models/model.onnx --export-report reports/export.json

The folder is written once. `make predict`'s path runs as users run it (`python -m serving.predict` in the
serving venv, a fresh process): its wall time from start to the CSV, and its own figure for the
classification alone (after the model is loaded). The server (params.yaml's default serve section, from the
same venv) is started once and sent every file of the folder, each as one multipart /predict, by `--concurrency`
clients; its time to /ready is printed apart. Both use every core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serving_inputs import images, untrained_model  # noqa: E402
from bench.serving_load import SERVER, free_port, load, wait_ready  # noqa: E402
from serving.app import stream_count  # noqa: E402
from tasks.core.params import ServeParams  # noqa: E402


def run_predict(python: str, folder: Path, cwd: Path) -> tuple[float, float]:
    """(wall seconds of the whole command, images/s it printed for the classification alone)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    done = subprocess.run([python, "-m", "serving.predict", str(folder), "--out", str(cwd / "out.csv")],
                          cwd=cwd, env=env, capture_output=True, text=True)  # fmt: skip
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"serving.predict failed:\n{done.stderr}")
    rate = re.search(r"classified \((\d+) img/s\)", done.stderr)
    assert rate, done.stderr
    return wall, float(rate.group(1))


def run_server(python: str, serve: dict, paths: dict, data: list[bytes], concurrency: int) -> tuple[float, float]:
    """(seconds to /ready, images/s over every file at `concurrency`)."""
    port = free_port()
    started = time.perf_counter()
    server = subprocess.Popen([python, "-c", SERVER, json.dumps(serve), json.dumps(paths), str(port)], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        ready = wait_ready(url, server, started, "server")
        result = asyncio.run(load(url, data, concurrency, len(data)))
        if result["errors"]:
            raise SystemExit(f"server answered {result['errors']} request(s) with an error")
    finally:
        server.terminate()
        server.wait(timeout=30)
    return ready, result["rps"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--onnx", type=Path, help="a model.onnx (default: an untrained resnet18)")
    parser.add_argument("--export-report", type=Path, help="the export.json holding --onnx's onnx_sha256")
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8, help="clients sending to the server at once")
    parser.add_argument("--python", default=str(ROOT / ".venv-serve" / "bin" / "python"),
                        help="the serving venv's interpreter (make serve-venv)")  # fmt: skip
    args = parser.parse_args()
    data = images(args.images)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        onnx, report = (args.onnx.resolve(), args.export_report.resolve()) if args.onnx else untrained_model(tmp, 64)
        folder = tmp / "inbox"
        folder.mkdir()
        for i, item in enumerate(data):
            (folder / f"{i:05d}.jpg").write_bytes(item)
        serve = ServeParams()
        settings = {"low_confidence": 0.0, "review_dir": str(tmp / "review"), "max_body_bytes": 10 * 2**20}
        paths = {"onnx": str(onnx), "reports": str(report.parent), "baseline": str(tmp / "no-baseline")}
        (tmp / "params.yaml").write_text(yaml.safe_dump({"paths": paths, "serve": settings}))
        print(f"model {onnx.name}, {len(data)} JPEGs, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
        wall, classify_rate = run_predict(args.python, folder, tmp)
        ready, server_rate = run_server(args.python, settings, paths, data, args.concurrency)
    streams = stream_count(serve)
    print(f"make predict:  {len(data) / wall:7.1f} img/s from start to CSV ({wall:.2f} s), "
          f"{classify_rate:7.1f} img/s once the model is loaded")  # fmt: skip
    print(f"server:        {server_rate:7.1f} img/s, one image per /predict, c={args.concurrency} "
          f"({streams} stream(s) x {serve.threads} thread(s)); ready {ready:.2f} s after start")  # fmt: skip
    print(f"ratio:         make predict {classify_rate / server_rate:.2f}x the server once loaded, "
          f"{len(data) / wall / server_rate:.2f}x counting its start")  # fmt: skip


if __name__ == "__main__":
    main()
