"""The dynamic batcher on its own: streams run at once, a lone request never waits, waiting requests are
coalesced up to max_batch in arrival order, one request's error stays its own, a full queue refuses.

`run` here is a plain function on the batcher's real threads that records the calls it gets and can be
held on a threading.Event, so the order of events is fixed, not left to timing.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import pytest

from serving.batching import Batcher, QueueFull

pytestmark = pytest.mark.fast  # unit-level: make test-fast


class Recorder:
    """Answers each item with (item, call number); holds every call while `gate` is cleared."""

    def __init__(self) -> None:
        self.calls: list[list[list[Any]]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Semaphore(0)

    def __call__(self, jobs: list[Sequence[Any]]) -> list[Any]:
        self.calls.append([list(items) for items in jobs])
        number = len(self.calls)
        self.started.release()
        assert self.gate.wait(10), "held call never released"
        return [ValueError(f"bad {items}") if "bad" in items else [(item, number) for item in items] for items in jobs]

    async def wait_started(self) -> None:
        assert await asyncio.to_thread(self.started.acquire, True, 10), "no call started"

    async def occupy(self, batcher: Batcher) -> asyncio.Task[Any]:
        """Submit ["a"] and hold its call, so the batcher's only stream stays busy until `gate` is set."""
        self.gate.clear()
        first = asyncio.create_task(batcher.submit(["a"]))
        await self.wait_started()
        return first


def test_a_lone_request_runs_at_once_as_a_batch_of_one() -> None:
    async def main() -> None:
        run, sizes = Recorder(), []
        batcher = Batcher(run, streams=2, max_batch=8, max_queue=16, on_batch=sizes.append)
        assert await batcher.submit(["a"]) == [("a", 1)]
        assert await batcher.submit(["b", "c"]) == [("b", 2), ("c", 2)]
        assert run.calls == [[["a"]], [["b", "c"]]] and sizes == [1, 2]
        assert batcher.queue_depth == 0 and batcher.busy == 0
        batcher.close()

    asyncio.run(main())


def test_requests_that_wait_for_a_busy_stream_are_coalesced_in_order_up_to_max_batch() -> None:
    async def main() -> None:
        run, sizes = Recorder(), []
        batcher = Batcher(run, streams=1, max_batch=4, max_queue=16, on_batch=sizes.append)
        first = await run.occupy(batcher)
        waiting = [asyncio.create_task(batcher.submit(items)) for items in (["b"], ["c"], ["d"], ["e", "f", "g"])]
        await asyncio.sleep(0)  # let every submit enqueue
        assert batcher.queue_depth == 6 and batcher.busy == 1
        run.gate.set()
        results = await asyncio.gather(first, *waiting)
        assert run.calls == [[["a"]], [["b"], ["c"], ["d"]], [["e", "f", "g"]]]  # e,f,g would make 6 > 4
        assert sizes == [1, 3, 3]
        assert results == [[("a", 1)], [("b", 2)], [("c", 2)], [("d", 2)], [("e", 3), ("f", 3), ("g", 3)]]
        batcher.close()

    asyncio.run(main())


def test_streams_run_at_the_same_time() -> None:
    both = threading.Barrier(2, timeout=10)  # breaks (and the run raises) unless two calls overlap

    def run(jobs: list[Sequence[Any]]) -> list[Any]:
        both.wait()
        return [list(items) for items in jobs]

    async def main() -> None:
        batcher = Batcher(run, streams=2, max_batch=1, max_queue=4)
        assert await asyncio.gather(batcher.submit([1]), batcher.submit([2])) == [[1], [2]]
        batcher.close()

    asyncio.run(main())


def test_one_requests_error_fails_only_that_request() -> None:
    async def main() -> None:
        run = Recorder()
        batcher = Batcher(run, streams=1, max_batch=8, max_queue=16)
        first = await run.occupy(batcher)
        good, bad, other = (asyncio.create_task(batcher.submit(items)) for items in (["b"], ["bad"], ["c"]))
        run.gate.set()
        assert await first == [("a", 1)]
        assert await good == [("b", 2)] and await other == [("c", 2)]
        with pytest.raises(ValueError, match="bad"):
            await bad
        assert run.calls[1] == [["b"], ["bad"], ["c"]]  # they shared the call
        batcher.close()

    asyncio.run(main())


def test_a_full_queue_refuses_and_a_cancelled_request_is_dropped() -> None:
    async def main() -> None:
        run = Recorder()
        batcher = Batcher(run, streams=1, max_batch=8, max_queue=3)
        first = await run.occupy(batcher)
        gone = asyncio.create_task(batcher.submit(["x", "y"]))
        kept = asyncio.create_task(batcher.submit(["k"]))
        await asyncio.sleep(0)
        with pytest.raises(QueueFull, match="3 images already wait for 1 busy streams"):
            await batcher.submit(["z"])
        gone.cancel()  # the client went away while it waited
        run.gate.set()
        assert await first == [("a", 1)] and await kept == [("k", 2)]
        assert run.calls == [[["a"]], [["k"]]] and batcher.queue_depth == 0
        batcher.close()

    asyncio.run(main())
