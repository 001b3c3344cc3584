"""The classifier the Batcher runs: requests' uploads -> one onnxruntime call -> top-k predictions per request,
each counted in the metrics and the drift window, the low-confidence ones kept for review."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from serving.model_slot import ModelSlot
from serving.monitoring import Metrics, log
from serving.review_store import ReviewFolder
from tasks.core.params import ServeParams
from tasks.images.imaging import ImageError, load_array
from tasks.release.drift import DriftWindow
from tasks.release.inference import OnnxModel, ranked, softmax


class Classifier:
    """Requests' uploads -> decoded -> one onnxruntime call for all of them -> top-k predictions per request;
    counts confidence and keeps the low-confidence inputs for review. Runs on a stream's thread (the
    Batcher's); the event loop only awaits it."""

    def __init__(self, state: ModelSlot, serve: ServeParams, metrics: Metrics, review: ReviewFolder) -> None:
        self.state, self.serve, self.metrics, self.review = state, serve, metrics, review

    def __call__(self, jobs: list[Sequence[tuple[str, bytes]]]) -> list[list[dict[str, Any]] | ImageError]:
        model, drift = self.state.snapshot()
        decoded: list[np.ndarray | ImageError] = [self.decode(model, items) for items in jobs]
        good = [arrays for arrays in decoded if not isinstance(arrays, ImageError)]
        probs = iter(softmax(model.logits(np.concatenate(good))) if good else [])
        out: list[list[dict[str, Any]] | ImageError] = []
        for items, arrays in zip(jobs, decoded, strict=True):
            if isinstance(arrays, ImageError):
                out.append(arrays)  # this request's own error; its companions in the call still get answers
            else:
                out.append([self.record(model, drift, name, data, next(probs)) for name, data in items])
        return out

    def decode(self, model: OnnxModel, items: Sequence[tuple[str, bytes]]) -> np.ndarray | ImageError:
        """One request's uploads -> uint8 (N, 3, S, S), or the first upload's error, naming the file."""
        arrays = []
        for name, data in items:
            try:
                arrays.append(load_array(data, model.spec, max_pixels=self.serve.max_pixels, limit="serve.max_pixels"))
            except ImageError as exc:
                return ImageError(exc.reason, f"{name}: {exc.detail}")
        return np.stack(arrays)

    def record(self, model: OnnxModel, drift: DriftWindow, name: str, data: bytes, probs: np.ndarray) -> dict[str, Any]:
        """One image's ImagePrediction, as the dict the response carries (built here, not validated again)."""
        metrics, serve = self.metrics, self.serve
        order = ranked(probs)
        top1 = float(probs[order[0]])
        margin = top1 - float(probs[order[1]]) if len(order) > 1 else top1
        low = top1 < serve.low_confidence
        top_k = [{"index": int(i), "label": model.class_names[i], "probability": float(probs[i])}
                 for i in order[: serve.top_k]]  # fmt: skip
        metrics.predictions.inc()
        metrics.top1.observe(top1)
        metrics.margin.observe(margin)
        metrics.predicted_class.labels(label=top_k[0]["label"]).inc()
        drift.add(int(order[0]), top1, margin)
        if low:
            metrics.low_confidence.inc()
            sha = hashlib.sha256(data).hexdigest()
            log.warning("low confidence %.3f (margin %.3f): %r %s -> %s", top1, margin, name, sha, top_k[0]["label"])
            probabilities = dict(zip(model.class_names, map(float, probs), strict=True))
            sidecar = {"file": name, "sha256": sha, "model_sha256": model.sha256, "predicted": top_k[0]["label"],
                       "top1_probability": top1, "margin": margin, "probabilities": probabilities}  # fmt: skip
            why = self.review.save(data, sha, top_k[0]["label"], sidecar)
            if why is None:
                metrics.review_saved.inc()
            else:
                metrics.review_skipped.labels(why=why).inc()
        return {"file": name, "top_k": top_k, "top1_probability": top1, "margin": margin, "low_confidence": low}
