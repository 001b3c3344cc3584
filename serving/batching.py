"""Concurrent inference streams with dynamic batching: Triton's default dynamic batcher, on CPU threads.

`Batcher(run, streams=..., max_batch=..., max_queue=...)`; `await batcher.submit(items)` gives the
results for those items (one request's images).

- Up to `streams` calls of `run` at once, each on a thread of its own. onnxruntime releases the GIL
  while it runs, so the streams use that many cores; with one session shared by all of them the
  weights are in memory once (`InferenceSession.run` is safe to call from several threads).
- A request that arrives while a stream is idle starts at once, alone: it never waits for companions
  (Triton's max_queue_delay of 0).
- Requests that arrive while every stream is busy wait. The next stream to come free takes every
  waiting request, in arrival order, up to `max_batch` images, and runs them as one call.
- `run` gets one list of items per request and returns one entry per request, a list of results or an
  exception, so a bad upload fails its own request only and its companions still get their answers.
- More than `max_queue` images waiting: `QueueFull` (the app answers 503 with Retry-After).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

Run = Callable[[list[Sequence[Any]]], list[Any]]


class QueueFull(Exception):
    """More images are waiting than serve.max_queue allows."""


@dataclass
class _Job:
    items: Sequence[Any]
    future: asyncio.Future[Any]


class Batcher:
    def __init__(
        self,
        run: Run,
        *,
        streams: int,
        max_batch: int,
        max_queue: int,
        on_batch: Callable[[int], None] | None = None,
        on_load: Callable[[int, int], None] | None = None,
    ) -> None:
        if streams < 1 or max_batch < 1 or max_queue < 1:
            raise ValueError(f"streams, max_batch and max_queue must be >= 1, got {streams}, {max_batch}, {max_queue}")
        self.streams, self.max_batch, self.max_queue = streams, max_batch, max_queue
        self._run, self._on_batch, self._on_load = run, on_batch, on_load
        self._executor = ThreadPoolExecutor(streams, thread_name_prefix="inference")
        self._idle = streams
        self._pending: deque[_Job] = deque()
        self._waiting = 0  # images in _pending

    @property
    def queue_depth(self) -> int:
        """Images waiting for a stream."""
        return self._waiting

    @property
    def busy(self) -> int:
        """Streams running a call now."""
        return self.streams - self._idle

    async def submit(self, items: Sequence[Any]) -> Any:
        """This request's results, computed alone or together with other waiting requests."""
        if self._idle == 0 and self._waiting + len(items) > self.max_queue:
            raise QueueFull(f"{self._waiting} images already wait for {self.streams} busy streams (serve.max_queue)")
        loop = asyncio.get_running_loop()
        job = _Job(items, loop.create_future())
        self._pending.append(job)
        self._waiting += len(items)
        self._dispatch(loop)
        self._report_load()
        return await job.future

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _take(self) -> list[_Job]:
        """The next batch: the oldest waiting job, then younger ones while they fit in max_batch."""
        jobs = [self._pending.popleft()]
        size = len(jobs[0].items)
        while self._pending and size + len(self._pending[0].items) <= self.max_batch:
            jobs.append(self._pending.popleft())
            size += len(jobs[-1].items)
        self._waiting -= size
        return [job for job in jobs if not job.future.done()]  # a cancelled request (client gone) is dropped

    def _dispatch(self, loop: asyncio.AbstractEventLoop) -> None:
        while self._idle and self._pending:
            jobs = self._take()
            if not jobs:
                continue
            self._idle -= 1
            if self._on_batch is not None:
                self._on_batch(sum(len(job.items) for job in jobs))
            call = loop.run_in_executor(self._executor, self._run, [job.items for job in jobs])
            call.add_done_callback(lambda done, jobs=jobs: self._finished(loop, jobs, done))

    def _finished(self, loop: asyncio.AbstractEventLoop, jobs: list[_Job], call: asyncio.Future[list[Any]]) -> None:
        self._idle += 1
        try:
            error, results = call.exception(), None
        except asyncio.CancelledError as exc:  # the executor was shut down
            error = exc
        if error is None:
            results = call.result()
        for i, job in enumerate(jobs):
            if job.future.done():
                continue
            outcome = error if results is None else results[i]
            if isinstance(outcome, BaseException):
                job.future.set_exception(outcome)
            else:
                job.future.set_result(outcome)
        self._dispatch(loop)
        self._report_load()

    def _report_load(self) -> None:
        """(queue depth, busy streams) to `on_load`, after each change: a request in, a call done."""
        if self._on_load is not None:
            self._on_load(self._waiting, self.busy)
