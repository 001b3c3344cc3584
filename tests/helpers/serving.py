"""A tiny served model's params and paths, and a real uvicorn on 127.0.0.1 for the serving tests."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil

from tasks.core.params import Params, Paths, ServeParams
from tests.helpers.prefect import free_port
from tests.helpers.project import TINY, deep_update

PARAMS = Params.model_validate(deep_update(TINY, {"export": {"formats": ["onnx"]}}))


SERVE = ServeParams(threads=1, warmup_runs=1, max_body_bytes=256 * 1024, max_batch_files=4, max_pixels=1_000_000)


def paths_of(root: Path) -> Paths:
    return Paths(onnx=root / "models" / "model.onnx", reports=root / "reports", baseline=root / "baseline")


SERVER = """
import json, sys, uvicorn
from serving.app import create_app
from tasks.core.params import Paths, ServeParams
serve, paths = json.loads(sys.argv[1]), json.loads(sys.argv[2])
app = create_app(ServeParams(**serve), Paths(**paths))
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[3]), log_level="warning")
"""


@contextmanager
def running_server(project: Path, review_dir: Path) -> Iterator[tuple[str, psutil.Process]]:
    """A real uvicorn serving the project's model on a free port of 127.0.0.1, once /ready says 200."""
    port = free_port()
    serve = SERVE.model_copy(update={"review_dir": review_dir}).model_dump(mode="json")
    paths = paths_of(project).model_dump(mode="json")
    proc = subprocess.Popen([sys.executable, "-c", SERVER, json.dumps(serve), json.dumps(paths), str(port)])
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
