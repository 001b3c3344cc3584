"""A tiny served model's params and paths, and a real uvicorn on 127.0.0.1, run by the serving venv's own
Python, for the serving tests."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import yaml

from serving.runtime import RUNTIME_ENV, ServerRuntime
from tasks.core.io import sha256_file, write_json
from tasks.core.params import Params, Paths, ServeParams
from tests.helpers.prefect import free_port
from tests.helpers.project import ROOT, TINY, deep_update

PARAMS = Params.model_validate(deep_update(TINY, {"export": {"formats": ["onnx"]}}))


def trained_and_exported(root: Path, params: Params = PARAMS) -> Path:
    """root/images (an ImageFolder already there) -> shards/, models/model.pt, models/model.onnx (+ exports/),
    reports/export.json: the pipeline's stages run in process, as the server finds them."""
    from tasks import export, preprocess, train

    preprocess.run(params.preprocess, seed=params.seed, source=root / "images", out_dir=root / "shards")
    train.run(
        params.train, seed=params.seed, shard_dir=root / "shards", model_path=root / "models" / "model.pt",
        history_path=root / "h.json", plot_path=root / "h.png", runs_dir=root / "runs", provenance={},
    )  # fmt: skip
    export.run(
        params.export, seed=params.seed, model_path=root / "models" / "model.pt", shard_dir=root / "shards",
        onnx_path=root / "models" / "model.onnx", exports_dir=root / "models" / "exports",
        report_path=root / "reports" / "export.json", timings_path=root / "reports" / "export_timings.json",
    )  # fmt: skip
    return root


SERVE = ServeParams(threads=1, warmup_runs=1, max_body_bytes=256 * 1024, max_batch_files=4, max_pixels=1_000_000)


def paths_of(root: Path) -> Paths:
    return Paths(onnx=root / "models" / "model.onnx", reports=root / "reports", baseline=root / "baseline",
                 runs=root / "runs")  # fmt: skip


SERVER = """
import json, sys, uvicorn
from pathlib import Path
from serving.app import create_app
from serving.runtime import ServerRuntime
from tasks.core.params import Paths, ServeParams
serve, paths = json.loads(sys.argv[1]), json.loads(sys.argv[2])
runtime = ServerRuntime.start(Path(sys.argv[4]))
try:
    app = create_app(ServeParams(**serve), Paths(**paths), runtime=runtime)
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[3]), log_level="warning")
finally:
    runtime.close()
"""


def runtime_of(project: Path, url: str) -> Path:
    """The runtime folder of the running_server at `url`: its reload token, as python -m serving keeps it."""
    return paths_of(project).runs / "serve" / url.rsplit(":", 1)[1]


def post_reload(project: Path, url: str) -> httpx.Response:
    """POST /reload with the server's token, as make reload sends it."""
    token = (runtime_of(project, url) / "token").read_text().strip()
    return httpx.post(f"{url}/reload", headers={"Authorization": f"Bearer {token}"}, timeout=120)


@functools.cache
def serve_python() -> Path:
    """The interpreter of the serving venv (make serve-venv: serving/requirements.txt only, no torch),
    built when missing; `make test` builds it before pytest starts."""
    make = subprocess.run(["make", "--no-print-directory", "serve-venv"], cwd=ROOT, capture_output=True, text=True)
    assert make.returncode == 0, make.stdout + make.stderr
    return ROOT / ".venv-serve" / "bin" / "python"


@contextmanager
def running_server(
    project: Path, review_dir: Path, log: Path | None = None, **serve: object
) -> Iterator[tuple[str, psutil.Process]]:
    """A real uvicorn from the serving venv, serving the project's model on a free port of 127.0.0.1,
    once /ready says 200. `serve`: fields of SERVE to change; `log`: a file for its stderr."""
    port = free_port()
    settings = SERVE.model_copy(update={"review_dir": review_dir, **serve}).model_dump(mode="json")
    paths = paths_of(project).model_dump(mode="json")
    runtime = str(paths_of(project).runs / "serve" / str(port))
    command = [str(serve_python()), "-c", SERVER, json.dumps(settings), json.dumps(paths), str(port), runtime]
    stderr = log.open("wb") if log is not None else None
    proc = subprocess.Popen(command, cwd=ROOT, stderr=stderr)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, "server exited"
            time.sleep(0.2)
        else:
            raise AssertionError("server not ready within 60 s")
        yield url, psutil.Process(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        if stderr is not None:
            stderr.close()


def base_url(host: str, port: int) -> str:
    return f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"


def environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in (RUNTIME_ENV, "PYTHONPATH")}


def write_params(root: Path, host: str, port: int, workers: int, **serve_fields: object) -> None:
    serve = {"host": host, "port": port, "workers": workers, "threads": 1, "warmup_runs": 1, "review_dir": "review",
             **serve_fields}  # fmt: skip
    paths = {"onnx": "models/model.onnx", "reports": "reports", "baseline": "baseline", "runs": "runs"}
    (root / "params.yaml").write_text(yaml.safe_dump({"serve": serve, "paths": paths}))


@contextmanager
def served(
    root: Path, host: str = "127.0.0.1", workers: int = 1, **serve_fields: object
) -> Iterator[tuple[str, ServerRuntime]]:
    """`python -m serving` from the serving venv in `root` (its params.yaml; `serve_fields`: more of its `serve`
    section), once every worker has its model."""
    port = free_port()
    write_params(root, host, port, workers, **serve_fields)
    log = (root / "server.log").open("wb")
    server = subprocess.Popen([str(serve_python()), "-m", "serving"], cwd=root, stdout=log, stderr=log,
                              env={**environment(), "PYTHONPATH": str(ROOT)})  # fmt: skip
    folder = root / "runs" / "serve" / str(port)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert server.poll() is None, (root / "server.log").read_text()[-3000:]
            reports = ServerRuntime.attach(folder).reports() if (folder / "token").is_file() else []
            if len(reports) == workers and all(r.generation is not None and r.model for r in reports):
                break
            time.sleep(0.3)
        else:
            raise AssertionError(f"{workers} workers not ready in 90 s: {(root / 'server.log').read_text()[-3000:]}")
        yield base_url(host, port), ServerRuntime.attach(folder)
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def promote(root: Path, model: Path) -> str:
    """`model` as the production model the server resolves (the export's file with its recorded hash)."""
    (root / "models").mkdir(parents=True, exist_ok=True)
    shutil.copy(model, root / "models" / "model.onnx")
    write_json(root / "reports" / "export.json", {"onnx_sha256": sha256_file(model)})
    return sha256_file(model)
