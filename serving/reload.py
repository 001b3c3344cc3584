"""POST /reload for every uvicorn worker of a server: the answering worker bumps the generation in the runtime
folder (serving/runtime.py); each worker's Follower sees it, loads the production model as it is on disk now and
swaps it in (serving/model_slot.py), then reports; the answer counts which worker serves which model."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import Counter
from typing import Annotated, Any

from fastapi import FastAPI, Header, HTTPException, Query, Request
from fastapi.responses import JSONResponse

from serving.errors import ERRORS
from serving.limits import set_reason
from serving.model_slot import ModelSlot, install, load, prepare
from serving.monitoring import Metrics, log
from serving.runtime import ServerRuntime, WorkerReport
from serving.schema import ErrorBody, ReloadError, ReloadResponse
from tasks.core.params import Paths, ServeParams

POLL_S = 0.25  # how soon an idle worker sees a reload: one small file read, four times a second
WAIT_S = 120.0  # how long an answer waits for every worker, unless the request says otherwise
RETIRE_S = 60.0  # a replaced model's drift window is unmapped this long after the swap (requests in flight)


class Follower:
    """This worker's model: loaded at start, and loaded again each time the server's reload generation moves on.
    A reload that fails keeps the model serving; a file with the same hash keeps it too, drift window and all.
    Another model gets an empty window (once per generation, whichever worker swaps first), and the replaced
    window's mapping and descriptor are given back."""

    def __init__(self, slot: ModelSlot, serve: ServeParams, paths: Paths, metrics: Metrics, runtime: ServerRuntime):
        self.slot, self.serve, self.paths, self.metrics, self.runtime = slot, serve, paths, metrics, runtime
        self.pid = os.getpid()
        self.generation: int | None = None  # the last generation carried out; None before the first load
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="model-follower", daemon=True)

    def load(self) -> None:
        """The first load. The generation is read before the files, so a reload asked meanwhile is not lost."""
        self._report(None, None)  # counted from now on: it is loading
        generation = self._current() or 0
        load(self.slot, self.serve, self.paths, self.metrics, self.runtime.shared)
        self._done(generation, self.slot.error)

    def reload(self, generation: int) -> None:
        previous = self.slot.info
        try:
            loaded = prepare(self.serve, self.paths, self.runtime.shared)
        except Exception as exc:  # the old model goes on serving
            error = f"{type(exc).__name__}: {exc}"
            log.error("reload failed, still serving %s: %s", previous, error)
            self._done(generation, error)
            return
        if previous is None or previous["sha256"] != loaded.info["sha256"]:
            if previous is not None:  # a model that comes back (A -> B -> A) starts with an empty window
                loaded.drift.restart(generation)
            retired = self.slot.drift
            install(self.slot, loaded, self.metrics)
            if retired is not None:  # requests in flight may still add to it: closed once they are surely done
                closer = threading.Timer(RETIRE_S, retired.close)
                closer.daemon = True
                closer.start()
        else:
            loaded.drift.close()  # the same model: the window it serves stays; this new mapping is not needed
        self._done(generation, None)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Look now rather than at the next poll (the worker answering a reload)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self.runtime.forget(self.pid)

    def _run(self) -> None:
        if self.generation is None:
            self.load()
        while not self._stop.is_set():
            self._wake.wait(POLL_S)
            self._wake.clear()
            current = self._current()
            if current is not None and self.generation is not None and current > self.generation:
                try:
                    self.reload(current)
                except Exception as exc:  # a bug: logged, this reload reported failed, and the worker follows on
                    log.exception("reload %d", current)
                    self._done(current, f"{type(exc).__name__}: {exc}")

    def _current(self) -> int | None:
        try:
            return self.runtime.generation()
        except (OSError, ValueError):  # the folder is gone: the server is stopping
            return None

    def _done(self, generation: int, error: str | None) -> None:
        self.generation = generation
        self._report(generation, error)

    def _report(self, generation: int | None, error: str | None) -> None:
        if self._stop.is_set():  # stopped: its report is gone, and so may be the folder
            return
        try:
            self.runtime.report(WorkerReport(self.pid, generation, self.slot.info, error))
        except OSError as exc:  # the worker serves on; a reload answer names it unreached
            log.error("cannot write this worker's report to %s: %s", self.runtime.folder, exc)


def check_token(authorization: str | None, runtime: ServerRuntime) -> None:
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        needs = f"the token the server wrote to {runtime.token_file} at start (make reload sends it)"
        raise HTTPException(
            403, f"forbidden: POST /reload needs the header 'Authorization: Bearer <token>' with {needs}"
        )
    if not runtime.token_matches(token.strip()):
        fresh = "the server writes a new one at each start"
        raise HTTPException(403, f"forbidden: the bearer token is not the one in {runtime.token_file} ({fresh})")


async def gather(runtime: ServerRuntime, generation: int, wait: float) -> tuple[list[WorkerReport], list[WorkerReport]]:
    """The live workers that carried out `generation` (or a later one), and those that did not within `wait` s."""
    deadline = time.monotonic() + wait
    while True:
        live = await asyncio.to_thread(runtime.reports)
        behind = [r for r in live if r.generation is None or r.generation < generation]
        if not behind or time.monotonic() >= deadline:
            return [r for r in live if r not in behind], behind
        await asyncio.sleep(0.1)


def _problem(report: WorkerReport, reason: str) -> dict[str, Any]:
    return {"pid": report.pid, "sha256": report.model["sha256"] if report.model else None, "reason": reason}


def _late(report: WorkerReport, generation: int, wait: float) -> str:
    if report.generation is None:
        return f"still loading its first model after {wait:g} s"
    return f"no report of reload {generation} within {wait:g} s (its last: reload {report.generation})"


def answer(previous: dict[str, Any] | None, generation: int, reached: list[WorkerReport],
           behind: list[WorkerReport], wait: float) -> tuple[int, dict[str, Any]]:  # fmt: skip
    """(status code, body): 200 when every worker serves one model, else 500 naming each worker left out."""
    served = Counter(r.model["sha256"] for r in reached if r.model)
    models = {r.model["sha256"]: r.model for r in reached if r.model}
    failed = [_problem(r, r.error) for r in reached if r.error]
    unreached = [_problem(r, _late(r, generation, wait)) for r in behind]
    model = models[served.most_common(1)[0][0]] if served else None
    body = {"model": model, "previous": previous, "generation": generation, "workers": dict(served),
            "failed": failed, "unreached": unreached}  # fmt: skip
    if not failed and not unreached and len(served) == 1:
        unchanged = previous is not None and model is not None and previous["sha256"] == model["sha256"]
        return 200, {"status": "unchanged" if unchanged else "reloaded", **body}
    if failed and len(failed) == len(reached) and not unreached:  # every worker refused the new model
        errors = "; ".join(sorted({f["reason"] for f in failed}))
        detail = f"reload_failed: {errors}; the previous model still serves"
        return 500, {"error": "reload_failed", "detail": detail, "status": "failed", **body}
    counts = ", ".join(f"{n} serve{'s' * (n == 1)} {sha[:12]}" for sha, n in served.most_common()) or "none answered"
    problems = [f"pid {f['pid']} failed: {f['reason']}" for f in failed]
    problems += [f"pid {u['pid']} unreached: {u['reason']}" for u in unreached]
    why = "; ".join(problems) or "they serve different models"
    detail = f"reload_incomplete: of {len(reached) + len(behind)} workers {counts}; {why}"
    return 500, {"error": "reload_incomplete", "detail": detail, "status": "incomplete", **body}


def add_reload(app: FastAPI, slot: ModelSlot) -> None:
    """POST /reload; the lifespan puts the server's runtime and this worker's Follower in app.state."""

    @app.post("/reload", response_model=ReloadResponse,
              responses={**ERRORS, 403: {"model": ErrorBody}, 500: {"model": ReloadError}})  # fmt: skip
    async def reload(
        request: Request,
        authorization: Annotated[str | None, Header(description="Bearer <the token in the runtime folder>")] = None,
        wait: Annotated[float, Query(gt=0, le=600, description="seconds to wait for every worker")] = WAIT_S,
    ) -> JSONResponse:
        """Every worker loads the production model as it is on disk now (after `make promote`), verifies its hash,
        warms it up and swaps it in; one that fails keeps serving the previous one. Needs the server's token."""
        runtime: ServerRuntime = request.app.state.runtime
        check_token(authorization, runtime)
        previous = slot.info
        try:
            generation = await asyncio.to_thread(runtime.bump)
        except OSError as exc:
            raise HTTPException(500, f"reload_failed: cannot write {runtime.folder} ({type(exc).__name__}: {exc}); "
                                "the previous model still serves") from None  # fmt: skip
        request.app.state.follower.wake()
        reached, behind = await gather(runtime, generation, wait)
        code, body = answer(previous, generation, reached, behind, wait)
        if code != 200:
            set_reason(request.scope, body["error"])
            log.error("%s", body["detail"])
        return JSONResponse(body, status_code=code)
