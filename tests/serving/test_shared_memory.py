"""A drift window and a count shared by processes (serving/shared_memory.py): what two processes add lands in
one window, exactly as one process adding it all; a block of another layout is refused, naming its file."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import numpy as np
import pytest

from serving.shared_memory import SharedBlockError, SharedFile
from tasks.release.drift import DriftWindow
from tasks.release.drift_thresholds import DriftThresholds
from tests.helpers.drift import CLASSES, confident, feed, reference_of

WINDOW = DriftThresholds.fixed(window=1000, min_predictions=200, value=0.25)


def stream(seed: int, n: int, classes: list[int]) -> np.ndarray:
    return confident(np.random.default_rng(seed), n, classes)


def reference() -> object:
    rng = np.random.default_rng(0)
    return reference_of(confident(rng, 1000, list(rng.integers(0, 4, 1000))))


def add_from_a_process(path: str, seed: int) -> None:
    """A worker: its own window over the shared block, fed 300 predictions of its own."""
    window = DriftWindow(CLASSES, reference(), WINDOW, memory=SharedFile(Path(path)))
    feed(window, stream(seed, 300, [seed % 4] * 150 + list(range(4)) * 37 + [0, 1]))


def test_two_processes_fill_one_window_as_one_process_would(tmp_path: Path) -> None:
    path = tmp_path / "drift.window"
    spawn = multiprocessing.get_context("spawn")  # as uvicorn starts its workers
    workers = [spawn.Process(target=add_from_a_process, args=(str(path), seed)) for seed in (1, 2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    shared = DriftWindow(CLASSES, reference(), WINDOW, memory=SharedFile(path))
    alone = DriftWindow(CLASSES, reference(), WINDOW)
    for seed in (1, 2):
        feed(alone, stream(seed, 300, [seed % 4] * 150 + list(range(4)) * 37 + [0, 1]))
    got, want = shared.report(), alone.report()
    assert got["window"]["filled"] == want["window"]["filled"] == 600
    assert got["predictions_total"] == want["predictions_total"]
    assert got["top1"] == want["top1"] and got["margin"] == want["margin"]
    assert [c["observed"] for c in got["classes"]] == [c["observed"] for c in want["classes"]]
    for name, statistic in want["statistics"].items():  # the same counts; sums added in another order
        assert got["statistics"][name]["value"] == pytest.approx(statistic["value"], abs=1e-9)
    assert got["verdict"] == want["verdict"] == "drift"  # each process leaned to one class of its own


def test_a_block_of_another_layout_is_refused_naming_its_file(tmp_path: Path) -> None:
    path = tmp_path / "drift.window"
    DriftWindow(CLASSES, reference(), WINDOW, memory=SharedFile(path))
    other = DriftThresholds.fixed(window=500, min_predictions=200, value=0.25)
    with pytest.raises(SharedBlockError, match="another layout") as refused:
        DriftWindow(CLASSES, reference(), other, memory=SharedFile(path))
    assert str(path) in str(refused.value)
