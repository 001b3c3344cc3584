"""The FastAPI app: image uploads -> top-k classes from the production ONNX model, plus health, metrics, drift.

`create_app(serve, paths)` builds it from the params' `serve` and `paths` sections; the model loads
(hash-verified) and warms up in a background thread, and /ready says 503 until that is done.
POST /predict takes the image as the raw body (Content-Type image/* or application/octet-stream) or as
the multipart field `file`. Every prediction goes into this worker's drift window (GET /drift).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import numpy as np
from fastapi import FastAPI, File, HTTPException, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.batching import Batcher, QueueFull
from serving.limits import BodyLimitMiddleware, RequestMetricsMiddleware, set_reason
from serving.monitoring import Metrics, ReviewFolder, log, log_drift
from serving.schema import BatchResponse, ErrorBody, ModelInfo, PredictResponse
from serving.uploads import PREDICT_BODY, upload_of
from tasks.core.environment import usable_cores
from tasks.core.params import Params, Paths, ServeParams, load_params
from tasks.images.imaging import ImageError, load_array
from tasks.release.drift import DriftThresholds, DriftWindow, Reference
from tasks.release.inference import OnnxModel, ranked, softmax
from tasks.release.production import ProductionModel, production_model

# Bad bytes are the client's problem: each ImageError reason gets a 4xx, never a 5xx.
STATUS_BY_REASON = {
    "empty_file": 422,
    "not_an_image": 415,
    "unsupported_mode": 415,
    "truncated": 422,
    "decode_error": 422,
    "too_small": 422,
    "decompression_bomb": 413,
}


ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorBody} for code in (400, 413, 415, 422, 503)}
PLAIN_REASONS = {400: "bad_request", 404: "not_found", 405: "method_not_allowed"}


@dataclass
class State:
    model: OnnxModel | None = None
    source: ProductionModel | None = None
    error: str | None = None
    info: dict[str, str] | None = None  # ModelInfo of the loaded model, as every response carries it
    drift: DriftWindow | None = None  # this worker's last serve.drift.window predictions vs the model's reference
    lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self) -> tuple[OnnxModel, DriftWindow]:
        """The model and its drift window, taken together (a reload swaps both at once)."""
        with self.lock:
            assert self.model is not None and self.drift is not None
            return self.model, self.drift

    def swap(self, loaded: Loaded) -> None:
        with self.lock:
            self.model, self.source, self.drift, self.info = loaded.model, loaded.source, loaded.drift, loaded.info
            self.error = None


@dataclass(frozen=True)
class Loaded:
    model: OnnxModel
    source: ProductionModel
    drift: DriftWindow
    info: dict[str, str]


def _loaded(serve: ServeParams, paths: Paths) -> Loaded:
    """The production model (hash-verified, warm) with its drift window; raises when it cannot be had."""
    source = production_model(paths)
    model = source.load(serve.threads)
    reference = Reference.from_metadata(model.metadata, model.class_names, str(source.path))
    size = model.spec.image_size
    largest = sorted({serve.max_batch, serve.max_batch_files}) if serve.warmup_runs else []
    for batch in [1] * serve.warmup_runs + largest:
        model.logits(np.zeros((batch, 3, size, size), np.uint8))
    release_freed_memory()
    thresholds, warnings = DriftThresholds.resolve(serve.drift, reference)
    if reference is None:
        log.warning("%s carries no drift reference (exported before drift references): /drift says 'no reference'; "
                    "re-export it to watch drift", source.path)  # fmt: skip
    for warning in warnings:
        log.warning("%s: %s", source.path, warning)
    sha = model.sha256
    info = ModelInfo(sha256=sha, source=source.source, version=f"{source.source}-{sha[:12]}").model_dump()
    return Loaded(model, source, DriftWindow(model.class_names, reference, thresholds, log_drift), info)


def _load(state: State, serve: ServeParams, paths: Paths, metrics: Metrics) -> None:
    try:
        loaded = _loaded(serve, paths)
    except Exception as exc:  # reported by /ready and the log; the process stays up for /health
        state.error = f"{type(exc).__name__}: {exc}"
        log.error("model not loaded: %s", state.error)
        return
    _serve(state, loaded, metrics)


def _serve(state: State, loaded: Loaded, metrics: Metrics) -> None:
    state.swap(loaded)
    metrics.model.clear()
    metrics.model.labels(sha256=loaded.model.sha256, source=loaded.source.source).set(1)
    metrics.ready.set(1)
    log.info("serving %s (%s, sha256 %s), warm", loaded.source.path, loaded.source.source, loaded.model.sha256)


def release_freed_memory() -> None:
    """Hand the heap that loading freed (the file's bytes, onnxruntime's load-time copies) back to the OS.

    glibc keeps it otherwise: about 80 MiB of RSS for a 43 MB resnet18."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL(None).malloc_trim(0)


def _error(
    code: int, reason: str, detail: str, request: Request, headers: dict[str, str] | None = None
) -> JSONResponse:
    set_reason(request.scope, reason)
    return JSONResponse({"error": reason, "detail": detail}, status_code=code, headers=headers)


class Classifier:
    """Requests' uploads -> decoded -> one onnxruntime call for all of them -> top-k predictions per request;
    counts confidence and keeps the low-confidence inputs for review. Runs on a stream's thread (the
    Batcher's); the event loop only awaits it."""

    def __init__(self, state: State, serve: ServeParams, metrics: Metrics, review: ReviewFolder) -> None:
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


def stream_count(serve: ServeParams) -> int:
    """serve.streams, or when 0 one stream per core left to each worker's threads (at least one)."""
    if serve.streams:
        return serve.streams
    return max(1, usable_cores() // (serve.workers * serve.threads))


async def infer(batcher: Batcher, items: list[tuple[str, bytes]]) -> list[dict[str, Any]]:
    try:
        return await batcher.submit(items)
    except QueueFull as exc:
        raise HTTPException(503, f"overloaded: {exc}", headers={"Retry-After": "1"}) from None


def _add_error_handlers(app: FastAPI) -> None:
    """Every error, ours or the framework's, as {"error": reason, "detail": ...} with its status."""

    @app.exception_handler(ImageError)
    async def _image_error(request: Request, exc: ImageError) -> JSONResponse:
        return _error(STATUS_BY_REASON.get(exc.reason, 422), exc.reason, str(exc), request)

    # Starlette's class: it also catches what the framework raises itself (a malformed multipart
    # body, an unknown route), so every error has the same {"error", "detail"} body.
    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = str(exc.detail)
        code, _, rest = detail.partition(": ")
        if not (rest and code.isidentifier()):  # ours read "reason_code: what happened"
            code = PLAIN_REASONS.get(exc.status_code, "http_error")
        return _error(exc.status_code, code, detail, request, exc.headers)  # keeps a 405's Allow header

    # Anything else (a bug, onnxruntime failing mid-call) is still a JSON body, not Starlette's plain text;
    # the traceback goes to the log (Starlette re-raises it for uvicorn to log), not to the client.
    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        return _error(500, "internal_error", f"the server failed on this request ({type(exc).__name__}); "
                      "its log has the details", request)  # fmt: skip

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return _error(422, "invalid_request", detail, request)


def create_app(serve: ServeParams, paths: Paths, *, load_in_background: bool = True) -> FastAPI:
    metrics = Metrics()
    state = State()
    review = ReviewFolder(serve.review_dir, serve.review_max_files, serve.review_max_file_bytes)
    classify = Classifier(state, serve, metrics, review)
    # serve.streams calls at once (decode + onnxruntime, each on its own thread, one shared session),
    # and the requests that wait for a stream coalesced into one call (serving/batching.py).
    batcher = Batcher(classify, streams=stream_count(serve), max_batch=serve.max_batch, max_queue=serve.max_queue,
                      on_batch=metrics.batch_size.observe)  # fmt: skip
    metrics.streams.set(batcher.streams)
    metrics.queue_depth.set_function(lambda: batcher.queue_depth)
    metrics.streams_busy.set_function(lambda: batcher.busy)
    metrics.watch_drift(lambda: state.drift)

    async def lifespan(app: FastAPI):  # noqa: ANN202 - FastAPI's lifespan protocol
        loader = threading.Thread(target=_load, args=(state, serve, paths, metrics), daemon=True)
        loader.start()
        if not load_in_background:
            loader.join()
        yield
        batcher.close()

    # /docs and /redoc with Swagger UI and ReDoc served by the app itself (fastapi-offline ships the
    # assets): FastAPI's own pages load them from a CDN and stay blank offline.
    app = FastAPIOffline(title="imagepipe serving", version="1", lifespan=lifespan)
    app.state.serving = state
    app.state.metrics = metrics
    app.add_middleware(BodyLimitMiddleware, max_bytes=serve.max_body_bytes)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    _add_error_handlers(app)

    _add_routes(app, state, serve, batcher, metrics, review)
    _add_reload(app, state, serve, paths, metrics)
    return app


def _add_routes(
    app: FastAPI, state: State, serve: ServeParams, batcher: Batcher, metrics: Metrics, review: ReviewFolder
) -> None:
    """/health, /ready, /metrics, /drift, /predict and /predict/batch."""

    def ensure_ready() -> None:
        if state.model is None:
            raise HTTPException(503, f"model_not_ready: {state.error or 'loading'}")

    @app.get("/health")
    async def health() -> dict[str, str]:
        """The process is up (says nothing about the model)."""
        return {"status": "ok"}

    @app.get("/ready", responses=ERRORS)
    async def ready() -> dict[str, Any]:
        """200 once the model is loaded, hash-verified and warm; 503 before (or when loading failed)."""
        ensure_ready()
        return {"status": "ready", "model": state.info}

    @app.get("/metrics", response_class=PlainTextResponse)  # documented as text/plain, which it is
    async def metrics_endpoint() -> Response:
        """Prometheus text format."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/drift", responses=ERRORS)
    async def drift() -> dict[str, Any]:
        """This worker's last serve.drift.window predictions against the model's test-split reference:
        per-class shares, PSI of class mix, top-1 and margin with thresholds, and a verdict."""
        ensure_ready()
        assert state.drift is not None
        scope = (f"this uvicorn worker only (pid {os.getpid()}); with serve.workers {serve.workers} each worker "
                 "keeps its own window, so a request here sees one worker's traffic")  # fmt: skip
        saved = {"dir": str(review.root.resolve()), "saved": review.recount(), "max_files": review.max_files}
        return {"model": state.info, "scope": scope, "workers": serve.workers, **state.drift.report(), "review": saved}

    @app.post("/predict", response_model=PredictResponse, responses=ERRORS, openapi_extra=PREDICT_BODY)
    async def predict(request: Request) -> JSONResponse:
        """One image -> the top-k classes with probabilities. The image is the raw body (Content-Type image/*
        or application/octet-stream; a filename in Content-Disposition names it), or the multipart field `file`."""
        ensure_ready()
        predictions = await infer(batcher, [await upload_of(request)])
        return JSONResponse({"model": state.info, "prediction": predictions[0]})

    @app.post("/predict/batch", response_model=BatchResponse, responses=ERRORS)
    async def predict_batch(files: Annotated[list[UploadFile], File()]) -> JSONResponse:
        """Several images (repeated multipart field `files`) -> one onnxruntime call, results in order."""
        ensure_ready()
        if len(files) > serve.max_batch_files:
            raise HTTPException(413, f"too_many_files: {len(files)} > serve.max_batch_files {serve.max_batch_files}")
        items = [(f.filename or f"files[{i}]", await f.read()) for i, f in enumerate(files)]
        predictions = await infer(batcher, items)
        return JSONResponse({"model": state.info, "predictions": predictions})


LOOPBACK = ("127.0.0.1", "::1", "testclient")  # testclient: Starlette's in-process test client


def _add_reload(app: FastAPI, state: State, serve: ServeParams, paths: Paths, metrics: Metrics) -> None:
    """POST /reload: the production model resolved again (after `make promote`), loaded, hash-verified and
    warmed beside the one serving, then swapped in with a fresh drift window; the old one serves until then
    and stays when the new one cannot be loaded. Loopback clients only."""
    reloading = asyncio.Lock()

    @app.post("/reload", responses={**ERRORS, 403: {"model": ErrorBody}, 500: {"model": ErrorBody}})
    async def reload(request: Request) -> dict[str, Any]:
        """Serve the production model as it is on disk now (after `make promote`); from 127.0.0.1 only."""
        if request.client is None or request.client.host not in LOOPBACK:
            raise HTTPException(403, "forbidden: POST /reload is accepted from 127.0.0.1 / ::1 only")
        async with reloading:
            previous = state.info
            try:
                loaded = await asyncio.to_thread(_loaded, serve, paths)
            except Exception as exc:
                log.error("reload failed, still serving %s: %s: %s", previous, type(exc).__name__, exc)
                raise HTTPException(500, f"reload_failed: {type(exc).__name__}: {exc}; the previous model "
                                    "still serves") from None  # fmt: skip
            if previous and previous["sha256"] == loaded.info["sha256"]:
                return {"status": "unchanged", "model": previous, "previous": previous}  # its drift window kept
            _serve(state, loaded, metrics)
        return {"status": "reloaded", "model": loaded.info, "previous": previous}


def app_from_params() -> FastAPI:
    """uvicorn's factory (`make serve`): params.yaml's `serve` and `paths` sections."""
    params: Params = load_params()
    logging.basicConfig(level=logging.INFO, format="[serve] %(levelname)s %(message)s")
    return create_app(params.serve, params.paths)
