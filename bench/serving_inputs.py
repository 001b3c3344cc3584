"""What bench/bench_serving.py serves and sends: an untrained resnet18 exported to ONNX with the metadata
the server reads, JPEGs of assorted sizes, and /predict bodies encoded once up front."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tasks.core.io import sha256_file
from tasks.core.paths import Paths
from tasks.images.imaging import PreprocessSpec
from tasks.release.onnx_metadata import write_metadata
from tasks.training.models import build_model
from tasks.training.serialize import export_onnx


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


BOUNDARY = "bench-boundary-7d3f"
FORM = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}


def multipart(name: str, data: bytes) -> bytes:
    """A /predict request body, encoded once up front: the load generator spends its time on sending."""
    head = f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
    return head.encode() + b"Content-Type: image/jpeg\r\n\r\n" + data + f"\r\n--{BOUNDARY}--\r\n".encode()
