"""The server's drift window survives a worker killed at any instruction: an update is journaled before it
touches the window and whoever takes the lock next redoes it; a block whose opener died before its header was
written is made again; windows give back their mapping and descriptor; a model that comes back starts empty."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from serving.shared_memory import SharedFile
from tasks.release.calibration import Psi
from tasks.release.drift import DriftWindow
from tasks.release.drift_thresholds import DriftThresholds
from tests.helpers.drift import CLASSES, confident, feed, reference_of

THRESHOLDS = DriftThresholds.fixed(window=50, min_predictions=20, value=0.25)
REFERENCE = reference_of(confident(np.random.default_rng(0), 1000, list(np.random.default_rng(1).integers(0, 4, 1000))))


class Died(Exception):
    """Stands for the worker's death at that instruction: the lock is let go as a dead process's flock is."""


def stream(n: int, seed: int = 3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return confident(rng, n, list(rng.integers(0, 4, n)))


def consistent(report: dict[str, Any]) -> None:
    """Every count of the window sums to its fill, as one that never crashed."""
    filled = report["window"]["filled"]
    assert sum(c["count"] for c in report["classes"]) == filled
    assert sum(report["top1"]["observed"]) == filled and sum(report["margin"]["observed"]) == filled


@pytest.mark.parametrize("dies_at", range(1, 7))
def test_a_writer_that_dies_mid_update_is_redone_by_the_next_holder(
    tmp_path: Path, dies_at: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full window (the update also takes the oldest prediction out): the writer dies at the n-th change of a
    PSI count of the update; another worker's window over the same block then reads the window as if the
    update had been made whole, the same as a window that was fed every prediction without a death."""
    path, probs = tmp_path / "drift.window", stream(61)
    writer = DriftWindow(CLASSES, REFERENCE, THRESHOLDS, memory=SharedFile(path))
    feed(writer, probs[:60])
    calls, change = {"n": 0}, Psi.change

    def dying(self: Psi, i: int, by: int) -> None:
        calls["n"] += 1
        if calls["n"] == dies_at:
            raise Died
        change(self, i, by)

    monkeypatch.setattr(Psi, "change", dying)
    with pytest.raises(Died):
        feed(writer, probs[60:])
    monkeypatch.setattr(Psi, "change", change)
    reader = DriftWindow(CLASSES, REFERENCE, THRESHOLDS, memory=SharedFile(path))
    got = reader.report()
    whole = DriftWindow(CLASSES, REFERENCE, THRESHOLDS)
    feed(whole, probs)
    want = whole.report()
    consistent(got)
    assert got["window"] == want["window"] and got["predictions_total"] == want["predictions_total"]
    assert got["top1"] == want["top1"] and got["margin"] == want["margin"]
    for name, statistic in want["statistics"].items():
        assert got["statistics"][name]["value"] == pytest.approx(statistic["value"], abs=1e-9)


def add_forever(path: str) -> None:
    window = DriftWindow(CLASSES, REFERENCE, THRESHOLDS, memory=SharedFile(Path(path)))
    probs = stream(1000, seed=os.getpid())
    while True:
        feed(window, probs)


def test_workers_killed_with_sigkill_in_a_loop_leave_a_window_whose_counts_sum_to_its_fill(tmp_path: Path) -> None:
    path = tmp_path / "drift.window"
    fork = multiprocessing.get_context("fork")
    rng = np.random.default_rng(5)
    for _ in range(12):
        workers = [fork.Process(target=add_forever, args=(str(path),)) for _ in range(2)]
        for worker in workers:
            worker.start()
        time.sleep(float(rng.uniform(0.2, 0.5)))
        for worker in workers:
            os.kill(worker.pid, signal.SIGKILL)
            worker.join(10)
        report = DriftWindow(CLASSES, REFERENCE, THRESHOLDS, memory=SharedFile(path)).report()
        consistent(report)
        assert report["window"]["filled"] == 50


def test_a_block_whose_opener_died_before_its_header_is_made_again(tmp_path: Path) -> None:
    path = tmp_path / "drift.window"
    DriftWindow(CLASSES, REFERENCE, THRESHOLDS, memory=SharedFile(path)).close()
    with open(path, "r+b") as handle:  # the size set, the header not yet written: what a kill between them leaves
        handle.write(bytes(8))
    window = DriftWindow(CLASSES, REFERENCE, THRESHOLDS, memory=SharedFile(path))
    feed(window, stream(30))
    assert window.report()["window"]["filled"] == 30


def test_windows_give_back_their_mapping_and_descriptor(tmp_path: Path) -> None:
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):  # a reload a day for three weeks, in one worker
        window = DriftWindow(CLASSES, REFERENCE, THRESHOLDS, memory=SharedFile(tmp_path / "drift.window"))
        feed(window, stream(5))
        window.close()
        window.add(0, 0.9, 0.8)  # a request that was in flight at the swap: nothing happens
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_model_that_comes_back_starts_with_an_empty_window_once_per_reload(tmp_path: Path) -> None:
    path = tmp_path / "drift-a.window"
    first = DriftWindow(CLASSES, REFERENCE, THRESHOLDS, memory=SharedFile(path))
    feed(first, stream(40, seed=7))  # A served, then B, now A again at reload 2
    worker_1 = DriftWindow(CLASSES, REFERENCE, THRESHOLDS, memory=SharedFile(path))
    assert worker_1.restart(2) and worker_1.report()["window"]["filled"] == 0
    feed(worker_1, stream(3))
    worker_2 = DriftWindow(CLASSES, REFERENCE, THRESHOLDS, memory=SharedFile(path))
    assert not worker_2.restart(2)  # the same reload: it joins the window worker 1 started
    assert worker_2.report()["window"]["filled"] == 3 and worker_2.report()["verdict"] == "not enough data"
