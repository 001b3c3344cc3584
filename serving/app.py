"""The FastAPI app: image uploads -> top-k classes from the production ONNX model, plus health, metrics, drift.

`create_app(serve, paths)` builds it from the params' `serve` and `paths` sections; the model loads
(hash-verified) and warms up in a background thread (serving/model_slot.py), and /ready says 503 until that is
done; POST /reload swaps it on every worker (serving/reload.py). POST /predict takes the image as the raw body
(Content-Type image/* or application/octet-stream) or as the multipart field `file`. Every prediction goes into
the server's drift window (GET /drift), which all its workers share (serving/shared_memory.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, File, HTTPException, Request, UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST

from serving.batching import Batcher, QueueFull
from serving.classifier import Classifier
from serving.errors import ERRORS, add_error_handlers
from serving.limits import BodyLimitMiddleware, RequestMetricsMiddleware
from serving.model_slot import ModelSlot
from serving.monitoring import Metrics, log
from serving.reload import Follower, add_reload
from serving.review_store import ReviewFolder
from serving.runtime import RUNTIME_ENV, ServerRuntime
from serving.schema import BatchResponse, PredictResponse
from serving.shared_memory import SharedFile
from serving.uploads import PREDICT_BODY, upload_of
from tasks.core.environment import usable_cores
from tasks.core.params import Params, Paths, ServeParams, load_params


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


def create_app(
    serve: ServeParams, paths: Paths, *, load_in_background: bool = True, runtime: ServerRuntime | None = None
) -> FastAPI:
    """The app; `runtime`: the server's runtime folder (serving/runtime.py), shared with its other workers.
    Without one the app makes a folder of its own for its lifetime (one worker: tests, an embedding)."""
    workers = serve.workers if runtime is not None else 1  # the workers /ready waits for
    metrics = Metrics()
    state = ModelSlot()
    review = ReviewFolder(serve.review_dir, serve.review_max_files, serve.review_max_file_bytes)
    classify = Classifier(state, serve, metrics, review)
    # serve.streams calls at once (decode + onnxruntime, each on its own thread, one shared session),
    # and the requests that wait for a stream coalesced into one call (serving/batching.py).
    batcher = Batcher(classify, streams=stream_count(serve), max_batch=serve.max_batch, max_queue=serve.max_queue,
                      on_batch=metrics.batch_size.observe, on_load=metrics.load)  # fmt: skip
    metrics.streams.set(batcher.streams)
    metrics.load(0, 0)
    metrics.watch_drift(lambda: state.drift)

    async def lifespan(app: FastAPI):  # noqa: ANN202 - FastAPI's lifespan protocol
        own = runtime or ServerRuntime.start(Path(tempfile.mkdtemp(prefix="imagepipe-serve-")))
        review.share(SharedFile(own.shared / "review.count"))  # the server's count, not this worker's
        if runtime is None:
            log.info("POST /reload takes the token in %s", own.token_file)
        follower = Follower(state, serve, paths, metrics, own)
        app.state.runtime, app.state.follower = own, follower
        if not load_in_background:
            follower.load()
        follower.start()  # loads (unless done above), then follows reloads
        try:
            yield
        finally:
            follower.stop()
            batcher.close()
            metrics.close()
            if runtime is None:
                own.close()

    # /docs and /redoc with Swagger UI and ReDoc served by the app itself (fastapi-offline ships the
    # assets): FastAPI's own pages load them from a CDN and stay blank offline.
    app = FastAPIOffline(title="imagepipe serving", version="1", lifespan=lifespan)
    app.state.serving = state
    app.state.metrics = metrics
    app.add_middleware(BodyLimitMiddleware, max_bytes=serve.max_body_bytes)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    add_error_handlers(app)

    _add_routes(app, state, serve, batcher, metrics, review, workers)
    add_reload(app, state)
    return app


def _add_routes(app: FastAPI, state: ModelSlot, serve: ServeParams, batcher: Batcher, metrics: Metrics,
                review: ReviewFolder, workers: int) -> None:  # fmt: skip
    """/health, /ready, /metrics, /drift, /predict and /predict/batch."""

    def ensure_ready() -> None:
        if state.model is None:
            raise HTTPException(503, f"model_not_ready: {state.error or 'loading'}")

    @app.get("/health")
    async def health() -> dict[str, str]:
        """The process is up (says nothing about the model)."""
        return {"status": "ok"}

    @app.get("/ready", responses=ERRORS)
    async def ready(request: Request) -> dict[str, Any]:
        """200 once every worker of the server has its model loaded, hash-verified and warm; 503 before (or when
        a worker's loading failed). `workers`: how many serve each model; `pid`: the worker that answered."""
        ensure_ready()
        reports = await asyncio.to_thread(request.app.state.runtime.reports)
        loaded = [r for r in reports if r.model is not None]
        if len(loaded) < workers:
            waiting = "; ".join(f"pid {r.pid}: {r.error or 'loading'}" for r in reports if r.model is None)
            raise HTTPException(503, f"model_not_ready: {len(loaded)} of {workers} workers serve a model"
                                f"{'; ' + waiting if waiting else ''}")  # fmt: skip
        served = Counter(r.model["sha256"] for r in loaded if r.model)
        return {"status": "ready", "model": state.info, "workers": dict(served), "pid": os.getpid()}

    @app.get("/metrics", response_class=PlainTextResponse)  # documented as text/plain, which it is
    async def metrics_endpoint() -> Response:
        """Prometheus text format: every worker's counters summed (serving/monitoring.py)."""
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/drift", responses=ERRORS)
    async def drift() -> dict[str, Any]:
        """The server's last serve.drift.window predictions (every worker's) against the model's test-split
        reference: per-class shares, PSI of class mix, top-1 and margin with thresholds, and a verdict."""
        ensure_ready()
        assert state.drift is not None
        scope = f"the server: the last predictions of its {workers} uvicorn worker{'s' * (workers > 1)} together"
        saved = {"dir": str(review.root.resolve()), "saved": review.recount(), "max_files": review.max_files}
        return {"model": state.info, "scope": scope, "workers": workers, **state.drift.report(), "review": saved}

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


def app_from_params() -> FastAPI:
    """uvicorn's factory (`make serve`): params.yaml's `serve` and `paths` sections."""
    params: Params = load_params()
    logging.basicConfig(level=logging.INFO, format="[serve] %(levelname)s %(message)s")
    folder = os.environ.get(RUNTIME_ENV)  # set by `python -m serving`, which made the folder for its workers
    return create_app(params.serve, params.paths, runtime=ServerRuntime.attach(Path(folder)) if folder else None)
