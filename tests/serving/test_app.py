"""Serving on a tiny real model: FastAPI app + onnxruntime, the pipeline's own preprocessing, hostile uploads.

A model trained for one epoch on colour-coded classes and exported to ONNX (the export stage's run()),
served in-process through FastAPI's TestClient, and once by a real uvicorn on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import socket
import struct
import subprocess
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import yaml
from fastapi.testclient import TestClient
from PIL import Image

from serving.app import create_app
from tasks.core.io import read_json
from tasks.images.imaging import is_image_name, load_array
from tasks.images.shards import ShardSplit
from tasks.training.models import load_model_file, predict_logits
from tests.helpers.prefect import free_port
from tests.helpers.project import ROOT
from tests.helpers.serving import SERVE, paths_of, running_server, serve_python


@pytest.fixture
def client(project: Path, tmp_path: Path) -> Iterator[TestClient]:
    serve = SERVE.model_copy(update={"review_dir": tmp_path / "review"})
    with TestClient(create_app(serve, paths_of(project), load_in_background=False)) as c:
        yield c


def raw_images(project: Path) -> list[Path]:
    return sorted(p for p in (project / "images").rglob("*") if p.is_file())


def png(img: Image.Image, **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", **kw)
    return buf.getvalue()


def jpeg(img: Image.Image, **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", **kw)
    return buf.getvalue()


def png_declaring(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims width x height pixels: a decompression bomb's signature."""
    chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def exif_rotated() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 on display
    return jpeg(Image.new("RGB", (60, 30), (200, 40, 40)), exif=exif)


def zoo() -> dict[str, tuple[bytes, set[int]]]:
    """Hostile or odd uploads -> the statuses they may get (200 = a correct prediction)."""
    rgb = Image.new("RGB", (48, 40), (30, 160, 90))
    good = jpeg(rgb)
    return {
        "empty": (b"", {422}),
        "text": (b"hello, this is not an image\n" * 10, {415}),
        "truncated_jpeg": (good[: len(good) // 2], {422}),
        "bomb_header_over_pillow_limit": (png_declaring(30_000, 30_000), {413}),
        "bomb_over_max_pixels": (png_declaring(2_000, 2_000), {413}),
        "png_16bit": (png(Image.fromarray((np.arange(48 * 40).reshape(40, 48) * 30).astype(np.uint16))), {200}),
        "cmyk_jpeg": (jpeg(rgb.convert("CMYK")), {200}),
        "rgba_png": (png(Image.new("RGBA", (40, 40), (10, 200, 10, 128))), {200}),
        "exif_rotated": (exif_rotated(), {200}),
        "tiny_1px": (png(Image.new("RGB", (1, 1))), {200}),
        "svg_text": (b"<svg xmlns='http://www.w3.org/2000/svg'/>", {415}),
    }


def softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits.astype(np.float64) - logits.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def test_predict_equals_the_pipelines_evaluation_of_the_image(client: TestClient, project: Path) -> None:
    from tasks.training.tempered import temperature_of, tempered

    model, spec, payload = load_model_file(project / "models" / "model.pt")
    model = tempered(model, temperature_of(payload))  # the served probabilities are the calibrated ones
    shard_rows = {row.tobytes(): row for s in ("train", "val", "test") for row in ShardSplit.open(
        project / "shards", s).all_images()}  # fmt: skip
    checked = 0
    for path in raw_images(project)[:6]:
        row = shard_rows[load_array(path.read_bytes(), spec).tobytes()]  # the training path's tensor
        expected = softmax(predict_logits(model, row[None], spec))[0]
        response = client.post("/predict", files={"file": (path.name, path.read_bytes(), "image/png")})
        assert response.status_code == 200, response.text
        body = response.json()
        top = body["prediction"]["top_k"]
        assert top[0]["index"] == int(np.argmax(expected))
        assert top[0]["label"] == spec.class_names[top[0]["index"]]
        for entry in top:
            assert abs(entry["probability"] - expected[entry["index"]]) < 1e-5
        assert body["model"]["sha256"] == read_json(project / "reports" / "export.json")["onnx_sha256"]
        assert body["model"]["source"] == "export"
        checked += 1
    assert checked == 6


def test_batch_is_one_call_with_the_single_results(client: TestClient, project: Path) -> None:
    paths = raw_images(project)[:3]
    files = [("files", (p.name, p.read_bytes(), "application/octet-stream")) for p in paths]
    batch = client.post("/predict/batch", files=files)
    assert batch.status_code == 200, batch.text
    predictions = batch.json()["predictions"]
    assert [p["file"] for p in predictions] == [p.name for p in paths]
    for path, got in zip(paths, predictions, strict=True):
        single = client.post("/predict", files={"file": (path.name, path.read_bytes())}).json()["prediction"]
        assert [t["index"] for t in got["top_k"]] == [t["index"] for t in single["top_k"]]
        assert np.allclose([t["probability"] for t in got["top_k"]], [t["probability"] for t in single["top_k"]],
                           atol=1e-6)  # fmt: skip


@pytest.mark.parametrize("name", list(zoo()))
def test_hostile_upload_gets_a_4xx_or_a_prediction(client: TestClient, name: str) -> None:
    data, allowed = zoo()[name]
    response = client.post("/predict", files={"file": (f"{name}.bin", data, "application/octet-stream")})
    assert response.status_code in allowed, f"{name}: {response.status_code} {response.text}"
    body = response.json()
    if response.status_code == 200:
        assert len(body["prediction"]["top_k"]) == 3 and body["prediction"]["file"] == f"{name}.bin"
    else:
        assert body["error"] and f"{name}.bin" in body["detail"], body
    # The same bytes as the raw body: the same status, error and answer as the multipart route.
    headers = {"content-type": "application/octet-stream", "content-disposition": f'inline; filename="{name}.bin"'}
    raw = client.post("/predict", content=data, headers=headers)
    assert raw.status_code == response.status_code and raw.json() == body, (raw.text, response.text)


def test_raw_body_predict_answers_as_the_multipart_route(client: TestClient, project: Path) -> None:
    """POST /predict with the image as the body (image/*, application/octet-stream): no multipart."""
    for path in raw_images(project)[:4]:
        data = path.read_bytes()
        form = client.post("/predict", files={"file": (path.name, data)}).json()
        kind = "image/png" if path.suffix == ".png" else "image/jpeg"
        disposition = f'inline; filename="{path.name}"'
        named = client.post(
            "/predict", content=data, headers={"content-type": kind, "content-disposition": disposition}
        )
        assert named.status_code == 200 and named.json() == form
        anonymous = client.post("/predict", content=data, headers={"content-type": "application/octet-stream"})
        assert anonymous.json()["prediction"]["file"] == "body"
        assert anonymous.json()["prediction"]["top_k"] == form["prediction"]["top_k"]
    big = client.post("/predict", content=b"\0" * (SERVE.max_body_bytes + 1), headers={"content-type": "image/png"})
    assert big.status_code == 413 and big.json()["error"] == "body_too_large"
    empty = client.post("/predict", content=b"", headers={"content-type": "image/jpeg"})
    assert empty.status_code == 422 and empty.json()["error"] == "empty_file"


def test_request_shape_errors_are_4xx_with_json(client: TestClient, project: Path) -> None:
    one = raw_images(project)[0].read_bytes()
    too_many = client.post("/predict/batch", files=[("files", (f"{i}.png", one)) for i in range(5)])
    assert too_many.status_code == 413 and too_many.json()["error"] == "too_many_files"
    big = client.post("/predict", files={"file": ("big.png", b"\0" * (SERVE.max_body_bytes + 1))})
    assert big.status_code == 413 and big.json()["error"] == "body_too_large"
    assert "Content-Length" in big.json()["detail"]
    no_file = client.post("/predict", data={"other": "x"})
    assert no_file.status_code == 422 and "file" in no_file.json()["detail"]
    not_multipart = client.post("/predict", content=b"{}", headers={"content-type": "application/json"})
    assert not_multipart.status_code == 415 and not_multipart.json()["error"] == "unsupported_media_type"
    assert "image/*" in not_multipart.json()["detail"] and "application/json" in not_multipart.json()["detail"]
    boundary = "b0undary"  # a part with no headers: the framework's multipart parser refuses it
    broken = client.post("/predict", content=f"--{boundary}\r\nTrue--{boundary}--\r\n".encode(),
                         headers={"content-type": f"multipart/form-data; boundary={boundary}"})  # fmt: skip
    assert broken.status_code == 400 and broken.json()["error"] == "bad_request"
    assert "multipart" in broken.json()["detail"]
    nope = client.get("/nope")
    assert nope.status_code == 404 and nope.json()["error"] == "not_found"
    wrong_method = client.request("TRACE", "/health")
    assert wrong_method.status_code == 405 and wrong_method.json()["error"] == "method_not_allowed"
    assert wrong_method.headers["allow"] == "GET"  # RFC 9110: a 405 names the methods that work


def test_docs_pages_load_every_asset_from_the_app_itself(client: TestClient) -> None:
    """Offline, FastAPI's own /docs is blank: it loads Swagger UI from a CDN. Ours serves the assets."""
    import re

    for page in ("/docs", "/redoc"):
        html = client.get(page)
        assert html.status_code == 200 and "text/html" in html.headers["content-type"]
        assets = re.findall(r"""(?:src|href)=["']([^"']+)["']""", html.text)
        assert assets, f"{page} references no script or stylesheet"
        assert not [a for a in assets if "//" in a], f"{page} loads assets from another host: {assets}"
        for asset in assets:
            got = client.get(asset)
            assert got.status_code == 200 and len(got.content) > 1000, (page, asset, got.status_code)
        assert "/openapi.json" in html.text
    assert client.get("/openapi.json").json()["info"]["title"] == "imagepipe serving"


def test_metrics_count_requests_errors_and_confidence(client: TestClient, project: Path) -> None:
    image = raw_images(project)[0].read_bytes()
    for _ in range(3):
        assert client.post("/predict", files={"file": ("a.png", image)}).status_code == 200
    assert client.post("/predict", files={"file": ("e.png", b"")}).status_code == 422
    text = client.get("/metrics").text
    assert 'serve_requests_total{code="200",endpoint="/predict"} 3.0' in text
    assert 'serve_errors_total{code="422",reason="empty_file"} 1.0' in text
    assert "serve_predictions_total 3.0" in text
    assert "serve_top1_probability_count 3.0" in text and "serve_top1_margin_count 3.0" in text
    assert 'serve_request_latency_seconds_count{endpoint="/predict"} 4.0' in text
    assert "serve_ready 1.0" in text


def test_low_confidence_inputs_go_to_a_bounded_review_folder(project: Path, tmp_path: Path) -> None:
    review = tmp_path / "review"
    serve = SERVE.model_copy(update={"low_confidence": 1.0, "review_dir": review, "review_max_files": 2})
    images = raw_images(project)[:4]
    with TestClient(create_app(serve, paths_of(project), load_in_background=False)) as c:
        for path in images:
            body = c.post("/predict", files={"file": (path.name, path.read_bytes())}).json()["prediction"]
            assert body["low_confidence"] is True
        text = c.get("/metrics").text
    saved = sorted(p for p in review.rglob("*") if p.is_file())
    pictures = [p for p in saved if is_image_name(p)]
    assert len(pictures) == 2 and len(saved) == 4  # bounded: two images, each with its sidecar
    assert "serve_low_confidence_total 4.0" in text and 'serve_review_skipped_total{why="full"} 2.0' in text
    for picture in pictures:
        sidecar = json.loads(picture.with_suffix(".json").read_text())
        assert sidecar["predicted"] == picture.parent.name  # ImageFolder layout: <class>/<file>
        assert sidecar["sha256"] == picture.stem and len(sidecar["probabilities"]) == 3
        assert picture.read_bytes() in {p.read_bytes() for p in images}


def test_the_review_folder_collects_again_once_its_images_are_taken_in(project: Path, tmp_path: Path) -> None:
    """review_max_files 3: three saves fill it; a take-in moves them out while the server runs; the next two
    low-confidence uploads are saved, with no restart and no GET /drift (which used to recount it)."""
    review, taken = tmp_path / "review", tmp_path / "raw"
    serve = SERVE.model_copy(update={"low_confidence": 1.0, "review_dir": review, "review_max_files": 3})
    images = raw_images(project)[:6]
    with TestClient(create_app(serve, paths_of(project), load_in_background=False)) as c:
        for path in images[:4]:
            c.post("/predict", files={"file": (path.name, path.read_bytes())})
        assert 'serve_review_skipped_total{why="full"} 1.0' in c.get("/metrics").text
        for picture in [p for p in review.rglob("*") if p.is_file()]:  # what make add-data INTO= does to them
            (taken / picture.parent.name).mkdir(parents=True, exist_ok=True)
            picture.rename(taken / picture.parent.name / picture.name)
        for path in images[4:]:
            c.post("/predict", files={"file": (path.name, path.read_bytes())})
        text = c.get("/metrics").text
    assert "serve_review_saved_total 5.0" in text and 'serve_review_skipped_total{why="full"} 1.0' in text
    assert len([p for p in review.rglob("*") if is_image_name(p)]) == 2


def test_images_the_review_page_discarded_do_not_fill_the_review_folder(project: Path, tmp_path: Path) -> None:
    review = tmp_path / "review"
    discarded = review / ".discarded" / "class_0"  # decided by a person: hidden, kept, no longer to review
    discarded.mkdir(parents=True)
    for i, path in enumerate(raw_images(project)[4:6]):
        shutil.copyfile(path, discarded / f"{i}{path.suffix}")
    serve = SERVE.model_copy(update={"low_confidence": 1.0, "review_dir": review, "review_max_files": 2})
    with TestClient(create_app(serve, paths_of(project), load_in_background=False)) as c:
        for path in raw_images(project)[:2]:
            c.post("/predict", files={"file": (path.name, path.read_bytes())})
        text = c.get("/metrics").text
    assert 'serve_review_skipped_total{why="full"}' not in text and "serve_review_saved_total 2.0" in text


def test_not_ready_until_a_verified_model_is_loaded(project: Path, tmp_path: Path) -> None:
    tampered = tmp_path / "p"
    (tampered / "models").mkdir(parents=True)
    (tampered / "reports").mkdir()
    (tampered / "models" / "model.onnx").write_bytes((project / "models" / "model.onnx").read_bytes() + b"\0")
    (tampered / "reports" / "export.json").write_bytes((project / "reports" / "export.json").read_bytes())
    with TestClient(create_app(SERVE, paths_of(tampered), load_in_background=False)) as c:
        assert c.get("/health").status_code == 200
        ready = c.get("/ready")
        assert ready.status_code == 503 and "does not match the recorded" in ready.json()["detail"]
        predict = c.post("/predict", files={"file": ("a.png", png(Image.new("RGB", (40, 40))))})
        assert predict.status_code == 503 and predict.json()["error"] == "model_not_ready"


def test_the_promoted_baseline_is_preferred(project: Path, tmp_path: Path) -> None:
    root = tmp_path / "p"
    (root / "baseline").mkdir(parents=True)
    onnx = (project / "models" / "model.onnx").read_bytes()
    (root / "baseline" / "model.onnx").write_bytes(onnx)
    with TestClient(create_app(SERVE, paths_of(root), load_in_background=False)) as c:  # no model.json: refused
        assert c.get("/ready").status_code == 503 and "model.json" in c.get("/ready").json()["detail"]
    digest = read_json(project / "reports" / "export.json")["onnx_sha256"]
    (root / "baseline" / "model.json").write_text(json.dumps({"onnx_sha256": digest}))
    with TestClient(create_app(SERVE, paths_of(root), load_in_background=False)) as c:
        assert c.get("/ready").json()["model"] == {"sha256": digest, "source": "baseline",
                                                   "version": f"baseline-{digest[:12]}"}  # fmt: skip


# --- a real uvicorn server on 127.0.0.1 ------------------------------------------------------------


@pytest.fixture
def server(project: Path, tmp_path: Path) -> Iterator[tuple[str, psutil.Process]]:
    with running_server(project, tmp_path / "review") as running:
        yield running


def test_real_server_streams_limits_and_stays_bounded(server: tuple[str, psutil.Process], project: Path) -> None:
    url, process = server
    limit = SERVE.max_body_bytes

    def chunks() -> Iterator[bytes]:  # no Content-Length: chunked transfer, 8x the limit if it were all read
        boundary = b'--x\r\nContent-Disposition: form-data; name="file"; filename="big.png"\r\n\r\n'
        yield boundary
        for _ in range(8 * limit // 65536):
            yield b"\0" * 65536

    with httpx.Client(timeout=30) as client:
        streamed = client.post(
            f"{url}/predict", content=chunks(), headers={"content-type": "multipart/form-data; boundary=x"}
        )
        assert streamed.status_code == 413 and streamed.json()["error"] == "body_too_large"
        assert "bytes read" in streamed.json()["detail"]
        raw = client.post(f"{url}/predict", content=(b"\0" * 65536 for _ in range(8 * limit // 65536)),
                          headers={"content-type": "image/jpeg"})  # fmt: skip
        assert raw.status_code == 413 and "bytes read" in raw.json()["detail"]

        cases = [*zoo().values(), (b"\0" * (limit + 1), {413})]
        good = raw_images(project)[0].read_bytes()
        codes: list[int] = []
        for i in range(20):  # warm-up round: allocator pools and caches settle
            data, _ = cases[i % len(cases)]
            client.post(f"{url}/predict", files={"file": ("w", data)})
        before = process.memory_info().rss
        for i in range(200):
            data, allowed = cases[i % len(cases)]
            if i % 25 == 0:  # many files in one batch
                response = client.post(f"{url}/predict/batch", files=[("files", (f"{j}", good)) for j in range(9)])
                allowed = {413}
            else:
                response = client.post(f"{url}/predict", files={"file": (f"{i}", data)})
            codes.append(response.status_code)
            assert response.status_code in allowed, (i, response.status_code, response.text)
        growth = process.memory_info().rss - before
    assert not [c for c in codes if c >= 500]
    assert growth < 50 * 2**20, f"server RSS grew {growth / 2**20:.1f} MiB over 200 hostile requests"
    print(f"RSS growth over 200 hostile requests: {growth / 2**20:.1f} MiB; codes {sorted(set(codes))}")
    assert httpx.get(f"{url}/ready", timeout=10).status_code == 200  # still serving after all of them


def test_an_exception_inside_inference_is_a_json_500(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from serving import app as serving_app

    def broken(self: object, model: object, items: object) -> None:
        raise RuntimeError("planted onnxruntime failure")

    serve = SERVE.model_copy(update={"review_dir": tmp_path / "review"})
    app = create_app(serve, paths_of(project), load_in_background=False)
    with TestClient(app, raise_server_exceptions=False) as c:
        monkeypatch.setattr(serving_app.Classifier, "decode", broken)
        response = c.post("/predict", files={"file": ("a.png", png(Image.new("RGB", (32, 32))))})
    assert response.status_code == 500 and response.headers["content-type"] == "application/json"
    assert response.json() == {
        "error": "internal_error",
        "detail": "the server failed on this request (RuntimeError); its log has the details",
    }


def _serve_from(folder: Path, params: dict[str, object]) -> subprocess.Popen[str]:
    """`python -m serving` (make serve) from the serving venv, in a folder holding only this params.yaml."""
    (folder / "params.yaml").write_text(yaml.safe_dump(params))
    return subprocess.Popen([str(serve_python()), "-m", "serving"], cwd=folder, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip


def test_make_serve_with_bad_params_says_one_line_and_no_traceback(tmp_path: Path) -> None:
    proc = _serve_from(tmp_path, {"serve": {"port": 0, "max_connections": "many"}})
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert err.startswith("[serve] error: params.yaml: invalid params; serve.port") and err.count("\n") == 1, err
    assert "serve.max_connections" in err


def test_make_serve_answers_503_beyond_max_connections(project: Path, tmp_path: Path) -> None:
    port = free_port()
    paths = {"onnx": str(project / "models/model.onnx"), "reports": str(project / "reports"),
             "baseline": str(tmp_path / "no-baseline")}  # fmt: skip
    proc = _serve_from(tmp_path, {"paths": paths, "serve": {"port": port, "max_connections": 1, "warmup_runs": 1,
                                                            "review_dir": str(tmp_path / "review")}})  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        assert httpx.get(f"{url}/health").status_code == 200
        with socket.create_connection(("127.0.0.1", port)):  # an idle client holds the one connection
            assert httpx.get(f"{url}/health").status_code == 503
        time.sleep(0.5)  # uvicorn notices the closed socket
        assert httpx.get(f"{url}/health").status_code == 200
    finally:
        proc.terminate()
        proc.communicate(timeout=20)
