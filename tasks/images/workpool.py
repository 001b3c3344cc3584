"""A process pool whose results come back in input order and survive a worker that dies.

`isolated_map(fn, items)` runs `fn` over `items` in worker processes, in chunks. When a worker
process is killed (a decoder segfault, the OOM killer), or hangs past `timeout_s` on one chunk (it is
then killed), the chunk it was working on is rerun one item per process, and the item that kills or
hangs a worker again gets `crashed(item, detail)` as its result: one bad input never takes the run down.

The parent talks to each worker over its own pipe, from the calling thread alone. A
ProcessPoolExecutor adds a feeder and a manager thread, and their hand-offs of the GIL cost the
parent more CPU than the pickled results themselves: on 2 cores that CPU is taken from the
decoders (bench/bench_data.py measures the stage with 1 and 2 workers).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

AHEAD = 2  # chunks queued at each worker, so that it never waits for the parent between chunks


def _context() -> multiprocessing.context.BaseContext:
    # fork starts workers in milliseconds and without re-importing the caller; spawn elsewhere.
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def _serve(
    conn: Connection, fn: Callable[[Any], Any], initializer: Callable[..., None] | None, initargs: tuple[Any, ...]
) -> None:
    """Worker loop: receive a chunk, send back ("ok", results) or ("error", exception, traceback)."""
    if initializer is not None:
        initializer(*initargs)
    try:
        while (chunk := conn.recv()) is not None:
            try:
                reply: tuple[Any, ...] = ("ok", [fn(item) for item in chunk])
            except Exception as exc:  # a bug in fn, not bad data: re-raised in the parent
                reply = ("error", exc, traceback.format_exc())
            try:
                conn.send(reply)
            except BrokenPipeError:
                raise
            except Exception as exc:  # a result or exception that cannot be pickled: nothing was sent
                failure = RuntimeError(f"a worker could not send its reply back: {type(exc).__name__}: {exc}")
                conn.send(("error", failure, reply[2] if reply[0] == "error" else traceback.format_exc()))
    except (EOFError, BrokenPipeError):
        pass  # the parent is gone: nothing is waiting for results


class _Worker:
    def __init__(self, ctx: Any, target: tuple[Any, ...]) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, *target[:3]), daemon=True)
        self.process.start()
        child.close()
        self.pending: deque[int] = deque()  # indices of the chunks sent to it, oldest first
        self.started = time.monotonic()  # when it began its oldest pending chunk (roughly: the last reply)

    def send(self, index: int, chunk: Sequence[Any]) -> None:
        self.conn.send(chunk)  # chunks of work items are small: this never blocks on a full pipe
        if not self.pending:
            self.started = time.monotonic()
        self.pending.append(index)

    def replied(self) -> int:
        self.started = time.monotonic()
        return self.pending.popleft()

    def stop(self, *, wait_for_exit: bool) -> None:
        if wait_for_exit:
            with contextlib.suppress(OSError):
                self.conn.send(None)
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()


def isolated_map(
    fn: Callable[[T], R],
    items: Sequence[T],
    *,
    workers: int,
    crashed: Callable[[T, str], R],
    chunksize: int = 16,
    initializer: Callable[..., None] | None = None,
    initargs: tuple[Any, ...] = (),
    timeout_s: float | None = None,
) -> Iterator[R]:
    """Yield fn(item) for every item, in order. `fn` must be picklable (a module-level function or
    a functools.partial of one); exceptions it raises propagate, since they are bugs, not bad data.
    `timeout_s`: the longest a worker may take over one chunk, and then over one item, before it is killed."""
    ctx = _context()
    target = (fn, initializer, initargs, timeout_s)
    chunks = [items[start : start + chunksize] for start in range(0, len(items), chunksize)]
    window = 4 * workers  # chunks handed out beyond the one being yielded: bounds unread results
    pool = [_Worker(ctx, target) for _ in range(min(workers, len(chunks)))]
    done: dict[int, list[R]] = {}
    handed_out = 0
    finished = False
    try:
        for index in range(len(chunks)):
            while index not in done:
                for k, worker in enumerate(pool):
                    while len(worker.pending) < AHEAD and handed_out < min(len(chunks), index + window):
                        try:
                            worker.send(handed_out, chunks[handed_out])
                        except OSError:  # it died since the last reply: settle what it held
                            pool[k] = worker = _replace(ctx, target, worker, chunks, done, crashed)
                            continue
                        handed_out += 1
                busy = [worker.conn for worker in pool if worker.pending]
                if not busy:  # a replacement settled the awaited chunk itself: nothing to wait for
                    continue
                ready = wait(busy, timeout=_time_left(pool, timeout_s))
                # Judged all at once, before any replacement (which can take a while): a worker whose reply
                # is already in its pipe is not hung.
                hung = [k for k, w in enumerate(pool) if w.conn not in ready and _overdue(w, timeout_s)
                        and not w.conn.poll(0)]  # fmt: skip
                for k in hung:  # killed, as if it had died
                    pool[k] = _replace(ctx, target, pool[k], chunks, done, crashed)
                for worker in [worker for worker in pool if worker.conn in ready]:
                    try:
                        reply = worker.conn.recv()
                    except (EOFError, OSError):  # the worker died, on the oldest chunk it was sent
                        pool[pool.index(worker)] = _replace(ctx, target, worker, chunks, done, crashed)
                        continue
                    done[worker.replied()] = _results(reply)
            yield from done.pop(index)
        finished = True
    finally:
        for worker in pool:
            worker.stop(wait_for_exit=finished)


def _overdue(worker: _Worker, timeout_s: float | None) -> bool:
    return timeout_s is not None and bool(worker.pending) and time.monotonic() - worker.started > timeout_s


def _time_left(pool: list[_Worker], timeout_s: float | None) -> float | None:
    """Until the first busy worker's chunk is overdue (None: wait as long as it takes)."""
    if timeout_s is None:
        return None
    started = min(worker.started for worker in pool if worker.pending)
    return max(0.0, started + timeout_s - time.monotonic())


def _replace(
    ctx: Any,
    target: tuple[Any, ...],
    dead: _Worker,
    chunks: list[Sequence[T]],
    done: dict[int, list[R]],
    crashed: Callable[[T, str], R],
) -> _Worker:
    """Settle the chunk a dead worker was on, one item per fresh process; hand its other chunks to
    a new worker."""
    dead.stop(wait_for_exit=False)
    lost = list(dead.pending)
    if lost:
        done[lost[0]] = [_alone(ctx, target, item, crashed) for item in chunks[lost[0]]]
    worker = _Worker(ctx, target)
    for index in lost[1:]:
        worker.send(index, chunks[index])
    return worker


def _alone(ctx: Any, target: tuple[Any, ...], item: T, crashed: Callable[[T, str], R]) -> R:
    timeout_s = target[3]
    worker = _Worker(ctx, target)
    hung = False
    try:
        worker.send(0, [item])
        if not worker.conn.poll(timeout_s):
            hung = True
            return crashed(item, f"no result after {timeout_s:g} s: the decoder hung on this file and was killed")
        reply = worker.conn.recv()
    except (EOFError, OSError):
        return crashed(item, "the worker process died while reading this file")
    finally:
        worker.stop(wait_for_exit=not hung)
    return _results(reply)[0]


def _results(reply: tuple[Any, ...]) -> list[Any]:
    """A worker's results, or the exception fn raised there, re-raised here with its traceback."""
    if reply[0] == "error":
        _, exc, remote = reply
        exc.add_note(f"raised in a worker process:\n{remote}")
        raise exc
    return reply[1]
