"""Serving without the training stack: the serving venv holds none of it, the app never imports it, and
the server run by that venv alone answers concurrent requests correctly, batched or not.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import httpx

from tasks.release.inference import OnnxModel
from tests.helpers.project import ROOT
from tests.helpers.serving import SERVE, paths_of, running_server, serve_python

TRAINING_STACK = ("torch", "torchvision", "pyarrow", "dvc", "prefect", "onnx", "matplotlib")

# Builds the app in a fresh interpreter, serves one /predict through it, then lists what got imported.
PROBE = """
import json, sys
from fastapi.testclient import TestClient
from serving.app import create_app
from tasks.core.params import Paths, ServeParams
serve, paths, image, heavy = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
with TestClient(create_app(ServeParams(**serve), Paths(**paths), load_in_background=False)) as client:
    response = client.post("/predict", files={"file": ("x.png", open(image, "rb").read())})
    assert response.status_code == 200, response.text
print(json.dumps(sorted(name for name in sys.modules if name.split(".")[0] in heavy)))
"""


def images_of(project: Path) -> list[Path]:
    return sorted(p for p in (project / "images").rglob("*") if p.is_file())


def test_the_serving_venv_has_none_of_the_training_stack() -> None:
    python = serve_python()
    found = subprocess.run([str(python), "-c", f"""
import importlib.util, json
print(json.dumps([m for m in {list(TRAINING_STACK)!r} if importlib.util.find_spec(m)]))
"""], capture_output=True, text=True, check=True)  # fmt: skip
    assert json.loads(found.stdout) == []
    requirements = (ROOT / "serving" / "requirements.txt").read_text()
    assert not re.search(r"^(torch|torchvision|pyarrow|dvc|prefect)\b", requirements, re.M)


def test_the_app_imports_no_training_module_even_after_a_prediction(project: Path, tmp_path: Path) -> None:
    # In the training venv, where torch and pyarrow are installed: only the imports keep them out.
    serve = SERVE.model_copy(update={"review_dir": tmp_path / "review"}).model_dump(mode="json")
    paths = paths_of(project).model_dump(mode="json")
    args = [json.dumps(serve), json.dumps(paths), str(images_of(project)[0]), json.dumps(TRAINING_STACK)]
    probe = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=ROOT, capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert json.loads(probe.stdout.splitlines()[-1]) == []


async def predict_all(url: str, uploads: list[tuple[str, bytes]]) -> list[httpx.Response]:
    """Every upload POSTed at once, each its own request."""
    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(*(client.post(f"{url}/predict", files={"file": up}) for up in uploads))


def batch_counts(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics").text
    found = dict(re.findall(r"^serve_batch_size_(count|sum) (\S+)$", text, re.M))
    return float(found["count"]), float(found["sum"])


def test_concurrent_requests_from_the_serving_venv_are_batched_and_each_gets_its_own_answer(
    project: Path, tmp_path: Path
) -> None:
    model = OnnxModel.load(project / "models" / "model.onnx")  # the same file, in this (training) venv
    paths = images_of(project)[:12]
    uploads = [(p.name, p.read_bytes()) for p in paths] * 2 + [("junk.bin", b"not an image at all" * 20)]
    expected = {p.name: {x.label: x.probability for x in model.predict(p.read_bytes(), top_k=10)} for p in paths}
    # One stream: every request that arrives while it runs waits, and the waiting ones share a call.
    with running_server(project, tmp_path / "review", streams=1, max_batch=8, top_k=3) as (url, _):
        responses = asyncio.run(predict_all(url, uploads))
        calls, images = batch_counts(url)
        metrics = httpx.get(f"{url}/metrics").text
    assert [r.status_code for r in responses] == [200] * 24 + [415]
    assert responses[-1].json()["error"] == "not_an_image" and "junk.bin" in responses[-1].json()["detail"]
    for (name, _), response in zip(uploads[:-1], responses[:-1], strict=True):
        prediction = response.json()["prediction"]
        assert prediction["file"] == name
        for entry in prediction["top_k"]:  # this image's own probabilities, not a neighbour's in the batch
            assert abs(entry["probability"] - expected[name][entry["label"]]) < 1e-5
    print(f"{calls:.0f} onnxruntime calls for {images:.0f} images")
    assert images == 25 and calls < 25, f"{calls:.0f} calls for {images:.0f} images: nothing was batched"
    assert "serve_streams 1.0" in metrics and "serve_queue_depth 0.0" in metrics
