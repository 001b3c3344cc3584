"""make reload against a real `python -m serving` (uvicorn's worker processes, the serving venv): every worker
swaps to the promoted model and the answer counts them, a worker that does not answer is named by pid, the server
is reached whatever serve.host binds, and the token, not the client's address, lets a reload in. The reloads run
scripts/reload_server.py with the serving venv's Python, as `make reload` does (no training venv)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from fastapi.testclient import TestClient

from serving.app import create_app
from serving.runtime import ServerRuntime
from tasks.core.io import sha256_file
from tasks.release.inference import OnnxModel
from tasks.release.onnx_metadata import write_metadata
from tests.helpers.project import ROOT
from tests.helpers.serving import SERVE, environment, paths_of, promote, serve_python, served


@pytest.fixture(scope="module")
def models(project: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three ONNX files of the package's tiny model, each with bytes (and a sha256) of its own: three promotions."""
    folder = tmp_path_factory.mktemp("variants")
    metadata = OnnxModel.load(project / "models" / "model.onnx").metadata
    variants = []
    for n in range(3):
        path = shutil.copy(project / "models" / "model.onnx", folder / f"model{n}.onnx")
        write_metadata(Path(path), {**metadata, "variant": str(n)})
        variants.append(Path(path))
    assert len({sha256_file(p) for p in variants}) == 3
    return variants


def make_reload(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """scripts/reload_server.py as `make reload` runs it: the serving venv's Python, from the project's folder."""
    command = [str(serve_python()), str(ROOT / "scripts" / "reload_server.py"), *args]
    return subprocess.run(command, cwd=root, env=environment(), capture_output=True, text=True, timeout=180)


def served_models(url: str, requests: int = 120) -> dict[int, set[str]]:
    """pid -> the sha256 values its /ready answers gave, over `requests` new connections, eight at a time."""

    def ready(_: int) -> tuple[int, str]:
        body = httpx.get(f"{url}/ready", timeout=10, headers={"Connection": "close"}).json()
        return body["pid"], body["model"]["sha256"]

    seen: dict[int, set[str]] = {}
    with ThreadPoolExecutor(8) as pool:
        for pid, sha in pool.map(ready, range(requests)):
            seen.setdefault(pid, set()).add(sha)
    return seen


def test_make_reload_swaps_every_worker_and_names_one_that_does_not_answer(
    project: Path, models: list[Path], tmp_path: Path
) -> None:
    root = tmp_path / "served"
    old = promote(root, models[0])
    with served(root, host="0.0.0.0", workers=2) as (url, runtime):
        pids = sorted(r.pid for r in runtime.reports())
        new = promote(root, models[1])
        done = make_reload(root)
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        assert answer["status"] == "reloaded" and answer["workers"] == {new: 2}, answer
        assert answer["previous"]["sha256"] == old and answer["model"]["sha256"] == new
        assert answer["failed"] == [] and answer["unreached"] == []
        assert served_models(url) == {pid: {new} for pid in pids}  # both workers answered, with the new model only
        image = next((project / "images" / "class_0").iterdir()).read_bytes()
        for _ in range(10):
            predicted = httpx.post(f"{url}/predict", content=image, headers={"content-type": "image/png"}).json()
            assert predicted["model"]["sha256"] == new

        again = make_reload(root)
        assert again.returncode == 0 and json.loads(again.stdout)["status"] == "unchanged", again.stderr
        assert json.loads(again.stdout)["workers"] == {new: 2}

        third = promote(root, models[2])
        stopped = pids[1]
        os.kill(stopped, signal.SIGSTOP)  # cannot follow: it must be named (uvicorn would replace it after 5 s)
        try:
            late = make_reload(root, "--wait", "1")
        finally:
            os.kill(stopped, signal.SIGCONT)
        assert late.returncode == 1 and late.stdout == "", late.stdout
        assert len(late.stderr.splitlines()) == 1, late.stderr
        assert "answered 500: reload_incomplete: of 2 workers " in late.stderr
        assert f"pid {stopped} unreached: no report of reload 3 within 1 s (its last: reload 2)" in late.stderr

        deadline = time.monotonic() + 30  # back, it catches up on its own
        while {r.model["sha256"] for r in runtime.reports() if r.model} != {third} and time.monotonic() < deadline:
            time.sleep(0.2)
        assert {pid: {third} for pid in sorted(r.pid for r in runtime.reports())} == served_models(url)


def lan_address() -> str:
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith(("127.", "169.254.")):
                return address.address
    pytest.skip("this machine has no IPv4 address besides loopback and link-local: nothing to bind serve.host to")


def test_make_reload_reaches_a_server_on_a_lan_address_and_no_token_is_refused(
    models: list[Path], tmp_path: Path
) -> None:
    root, host = tmp_path / "served", lan_address()
    promote(root, models[0])
    with served(root, host=host) as (url, runtime):
        assert runtime.token_file.stat().st_mode & 0o777 == 0o600
        missing = httpx.post(f"{url}/reload")  # from the LAN address, not loopback
        assert missing.status_code == 403 and missing.json()["error"] == "forbidden"
        assert "'Authorization: Bearer <token>'" in missing.json()["detail"]
        assert str(runtime.token_file.relative_to(root)) in missing.json()["detail"]  # as make serve names it
        wrong = httpx.post(f"{url}/reload", headers={"Authorization": "Bearer " + "0" * 64})
        assert wrong.status_code == 403 and "is not the one in" in wrong.json()["detail"]
        assert httpx.get(f"{url}/ready").json()["model"]["sha256"] == sha256_file(models[0])  # nothing changed

        new = promote(root, models[1])
        done = make_reload(root)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["status"] == "reloaded" and json.loads(done.stdout)["workers"] == {new: 1}
        assert httpx.get(f"{url}/ready").json()["model"]["sha256"] == new

        second = subprocess.run([str(serve_python()), "-m", "serving"], cwd=root, capture_output=True, text=True,
                                env={**environment(), "PYTHONPATH": str(ROOT)}, timeout=60)  # fmt: skip
        assert second.returncode == 2 and "in use by another server" in second.stderr, second.stderr
        token = {"Authorization": f"Bearer {runtime.token_file.read_text().strip()}"}
        assert httpx.post(f"{url}/reload", headers=token).json()["status"] == "unchanged"  # its folder untouched
    gone = make_reload(root)
    assert gone.returncode == 1 and "is missing: no server runs on serve.port" in gone.stderr, gone.stderr


def test_the_test_client_gets_no_reload_without_the_token(project: Path, tmp_path: Path) -> None:
    """Starlette's TestClient (client host "testclient") is no exception: the token file is the only way in."""
    serve = SERVE.model_copy(update={"review_dir": tmp_path / "review"})
    runtime = ServerRuntime.start(tmp_path / "runtime")
    with TestClient(create_app(serve, paths_of(project), load_in_background=False, runtime=runtime)) as client:
        refused = client.post("/reload")
        assert refused.status_code == 403 and "Authorization: Bearer" in refused.json()["detail"]
        token = (tmp_path / "runtime" / "token").read_text().strip()
        answer = client.post("/reload", headers={"Authorization": f"Bearer {token}"}).json()
    runtime.close()
    assert answer["status"] == "unchanged" and answer["workers"] == {answer["model"]["sha256"]: 1}
