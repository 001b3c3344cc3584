"""A process pool whose results come back in input order and survive a worker that dies.

`isolated_map(fn, items)` runs `fn` over `items` in worker processes. When a worker process is
killed (a decoder segfault, the OOM killer), the chunk it held is rerun one item per task in a
fresh pool, and the item that kills a worker again gets `crashed(item, detail)` as its result:
one bad input never takes the run down.
"""

from __future__ import annotations

import multiprocessing
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def _context() -> multiprocessing.context.BaseContext:
    # fork starts workers in milliseconds and without re-importing the caller; spawn elsewhere.
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def _run_chunk(fn: Callable[[Any], Any], chunk: Sequence[Any]) -> list[Any]:
    return [fn(item) for item in chunk]


class _Pool:
    def __init__(self, workers: int, initializer: Callable[..., None] | None, initargs: tuple[Any, ...]) -> None:
        self.args = (workers, initializer, initargs)
        self.executor = self._start()

    def _start(self) -> ProcessPoolExecutor:
        workers, initializer, initargs = self.args
        return ProcessPoolExecutor(workers, mp_context=_context(), initializer=initializer, initargs=initargs)

    def restart(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.executor = self._start()

    def submit(self, fn: Callable[[Any], Any], chunk: Sequence[Any]) -> Future[list[Any]]:
        return self.executor.submit(_run_chunk, fn, chunk)


def isolated_map(
    fn: Callable[[T], R],
    items: Sequence[T],
    *,
    workers: int,
    crashed: Callable[[T, str], R],
    chunksize: int = 16,
    initializer: Callable[..., None] | None = None,
    initargs: tuple[Any, ...] = (),
) -> Iterator[R]:
    """Yield fn(item) for every item, in order. `fn` must be picklable (a module-level function or
    a functools.partial of one); exceptions it raises propagate, since they are bugs, not bad data."""
    chunks = [items[start : start + chunksize] for start in range(0, len(items), chunksize)]
    window = 4 * workers  # chunks in flight: bounds the memory held by finished-but-unread results
    pool = _Pool(workers, initializer, initargs)
    pending: deque[Future[list[Any]]] = deque()
    try:
        submitted = 0
        for index, chunk in enumerate(chunks):
            while submitted < len(chunks) and submitted < index + window:
                pending.append(pool.submit(fn, chunks[submitted]))
                submitted += 1
            future = pending.popleft()
            try:
                results = future.result()
            except BrokenProcessPool:
                pool.restart()
                results = [_one_by_one(pool, fn, item, crashed) for item in chunk]
                # Everything else in flight died with the pool: send it again.
                pending = deque(pool.submit(fn, chunks[k]) for k in range(index + 1, submitted))
            yield from results
    finally:
        pool.executor.shutdown(wait=True, cancel_futures=True)


def _one_by_one(pool: _Pool, fn: Callable[[T], R], item: T, crashed: Callable[[T, str], R]) -> R:
    try:
        return pool.submit(fn, [item]).result()[0]
    except BrokenProcessPool:
        pool.restart()
        return crashed(item, "the worker process died while reading this file")
