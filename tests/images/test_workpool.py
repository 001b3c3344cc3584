"""tasks.images.workpool.isolated_map: results in input order, a dying worker costs only the items that
kill it, bugs propagate with their type, and no worker process outlives the call."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from tasks.images.workpool import isolated_map

KILLERS = {7, 8, 15, 39}


def _killed_by_some(item: int) -> int:
    if item in KILLERS:
        os.kill(os.getpid(), signal.SIGKILL)  # what a segfaulting decoder looks like from outside
    return item * 10


def _buggy(item: int) -> int:
    if item == 5:
        raise ValueError(f"bug on item {item}")
    return item


def _unpicklable_result(item: int) -> object:
    return lambda: item


@pytest.mark.parametrize(("workers", "chunksize"), [(1, 4), (2, 3), (3, 16)])
def test_results_in_order_and_each_killer_costs_one_item(workers: int, chunksize: int) -> None:
    results = list(
        isolated_map(_killed_by_some, list(range(40)), workers=workers, chunksize=chunksize, crashed=lambda i, why: -i)
    )
    assert results == [-i if i in KILLERS else i * 10 for i in range(40)]
    assert multiprocessing.active_children() == []


def _slow(item: int) -> int:
    time.sleep(0.002)
    return item * 10


def test_workers_killed_from_outside_lose_nothing() -> None:
    """The OOM killer picks a worker, busy (found by its pipe closing) or idle (found when the next
    chunk is sent): its chunks are redone, every result arrives."""
    results = []
    for k, result in enumerate(isolated_map(_slow, list(range(300)), workers=2, chunksize=5, crashed=lambda i, w: -i)):
        if k in (20, 150):
            if k == 150:
                time.sleep(0.3)  # the workers finish what they were handed and wait, idle
            for child in multiprocessing.active_children():
                os.kill(child.pid, signal.SIGKILL)
                child.join(timeout=10)  # gone before the pool talks to it again
        results.append(result)
    assert results == [i * 10 for i in range(300)]
    assert multiprocessing.active_children() == []


def test_a_bug_in_fn_propagates_with_its_type_and_stops_the_workers() -> None:
    with pytest.raises(ValueError, match="bug on item 5") as raised:
        list(isolated_map(_buggy, list(range(50)), workers=2, chunksize=2, crashed=lambda i, why: -1))
    assert any("raised in a worker process" in note for note in raised.value.__notes__)
    assert multiprocessing.active_children() == []


def test_an_unpicklable_result_is_an_error_not_a_crash_item() -> None:
    with pytest.raises(Exception, match="pickle"):
        list(isolated_map(_unpicklable_result, [1, 2, 3], workers=1, crashed=lambda i, why: None))
    assert multiprocessing.active_children() == []


def test_stopping_early_stops_the_workers() -> None:
    results = isolated_map(_buggy, list(range(5, 1000)), workers=2, chunksize=1, crashed=lambda i, why: -1)
    with pytest.raises(ValueError):
        next(results)
    assert multiprocessing.active_children() == []
    taken = isolated_map(_killed_by_some, list(range(1000)), workers=2, chunksize=2, crashed=lambda i, why: -1)
    assert [next(taken) for _ in range(3)] == [0, 10, 20]
    taken.close()  # the consumer gave up (an error of its own): workers are killed, not waited for
    assert multiprocessing.active_children() == []


def test_no_items_starts_no_worker() -> None:
    assert list(isolated_map(_buggy, [], workers=2, crashed=lambda i, why: -1)) == []


def _hangs_on_some(item: int) -> int:
    if item in (3, 11):
        time.sleep(3600)  # a decoder stuck in a loop on a crafted file
    return item * 10


@pytest.mark.parametrize("workers", [1, 2])
def test_a_hung_worker_is_killed_and_costs_only_the_item_it_hangs_on(workers: int) -> None:
    started = time.monotonic()
    results = list(isolated_map(_hangs_on_some, list(range(16)), workers=workers, chunksize=4, timeout_s=1.0,
                                crashed=lambda item, why: why))  # fmt: skip
    hung = "no result after 1 s: the decoder hung on this file and was killed"
    assert results == [hung if i in (3, 11) else i * 10 for i in range(16)]
    assert time.monotonic() - started < 30  # two chunks timed out, then their items one by one
    assert multiprocessing.active_children() == []
