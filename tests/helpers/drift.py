"""Drift helpers shared by the tests: probabilities of a model leaning to some classes, a drift reference made
from them, a window fed them; a real HTTP server answering /drift with a given report; one nightly run."""

from __future__ import annotations

import contextlib
import http.server
import json
from pathlib import Path
from typing import Any

import numpy as np

from tasks.release.drift import DriftWindow
from tasks.release.drift_reference import REFERENCE_KEY, Reference, build_reference, reference_json, top1_and_margin
from tests.helpers.prefect import free_port

CLASSES = ("cat", "dog", "fox", "owl")


def confident(rng: np.random.Generator, n: int, classes: list[int], sharpness: float = 4.0) -> np.ndarray:
    """Probabilities (n, 4) of a model that picks classes[i] with some confidence."""
    logits = rng.normal(size=(n, len(CLASSES)))
    logits[np.arange(n), classes] += sharpness + rng.normal(size=n)
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def reference_of(probs: np.ndarray) -> Reference:
    meta = {REFERENCE_KEY: reference_json(build_reference(probs, CLASSES))}
    ref = Reference.from_metadata(meta, CLASSES, "model.onnx")
    assert ref is not None
    return ref


def feed(window: DriftWindow, probs: np.ndarray) -> None:
    top1, margin = top1_and_margin(probs)
    for row, t, m in zip(probs, top1, margin, strict=True):
        window.add(int(row.argmax()), float(t), float(m))


class DriftServer:
    """A real HTTP server on 127.0.0.1 whose GET /drift answers `report` (JSON, 200), or 503 when it is None."""

    def __init__(self) -> None:
        self.report: dict[str, Any] | None = None
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the handler's protocol
                body = json.dumps(owner.report).encode() if owner.report is not None else b'{"detail": "not ready"}'
                self.send_response(200 if owner.report is not None and self.path == "/drift" else 503)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"


def nightly(repo: Path, server: str | None = None) -> Any:
    """One night: regression-flow run in-process in `repo` (its working directory), its final state."""
    from flows.regression_flow import regression_flow

    with contextlib.chdir(repo):
        return regression_flow(server=server, return_state=True)
