"""A tiny served model's params and paths, and a real uvicorn on 127.0.0.1, run by the serving venv's own
Python, for the serving tests."""

from __future__ import annotations

import functools
import json
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil

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
