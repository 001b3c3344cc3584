"""Drift: how the served model's predictions compare with what it predicted on the test split.

export: test-split probabilities -> a reference in the ONNX metadata (tasks/release/drift_reference.py): the
predicted-class counts, counts of top-1 probability and of margin (top-1 minus top-2) in bins of equal test-set
mass (deciles), and each statistic's threshold at the server's window sizes, calibrated to a false-alarm rate.

serving: each prediction -> `DriftWindow.add` (the last `window` predictions, counted per class and
per bin, each statistic kept up to date in O(1)) -> `DriftWindow.report()`: the population stability
index (PSI) of the class mix, of top-1 and of margin against the reference, each with its threshold and
where it came from (tasks/release/drift_thresholds.py), and a verdict with hysteresis. Pure numpy/stdlib
(no torch, no scipy): the torch-free serving venv imports it.

PSI = sum over bins of (observed - expected) * ln(observed / expected), a share never below 1e-4 so
an empty bin stays finite. Its sampling noise grows with the number of bins (the class mix has one per
class) and shrinks with the window and the test split, so no fixed threshold means the same for 10 and
1,000 classes: export calibrates each model's thresholds to a false-alarm rate (tasks/release/calibration.py)
and bench/bench_drift.py measures the rate they give.
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import Any

from tasks.release.calibration import SHARE_FLOOR, STATISTICS, Psi, shares
from tasks.release.drift_reference import Reference
from tasks.release.drift_thresholds import DRIFT, NO_REFERENCE, NOT_ENOUGH, OK, DriftThresholds
from tasks.release.window_memory import Layout, LocalMemory, WindowMemory

log = logging.getLogger(__name__)

MAX_WINDOW = round(1 / SHARE_FLOOR)  # up to here an observed bin with a count is never under the floor (O(1) PSI)
VERDICTS = (OK, DRIFT, NOT_ENOUGH, NO_REFERENCE)


# The window's `state` cells: the ring's head and fill, the verdict's alert, predictions since the sums' refresh;
# the journal of the update in progress (BEGUN moves on once it is written, DONE catches up when the update is
# complete: a holder of the lock that finds them apart redoes it, `_recover`); the reload generation it started at.
HEAD, FILLED, ALERT, SINCE_REFRESH, BEGUN, DONE, J_HEAD, J_FILLED, J_INDEX, J_T, J_M, J_TOTAL, STARTED = range(13)
STATE_CELLS = 13


def window_layout(classes: int, window: int, bins: Sequence[int]) -> Layout:
    """A window's arrays: the ring of its predictions (class, top-1 bin, margin bin), its state cells, the counts
    by class since start and in the window, the top-1 and margin bins, and each statistic's PSI counts and sums
    (`bins`: each statistic's bin count; none without a reference)."""
    layout = [("ring", "q", 3 * window), ("state", "q", STATE_CELLS), ("total", "q", classes),
              ("classes", "q", classes), ("top1", "q", bins[1] if bins else 1),
              ("margin", "q", bins[2] if bins else 1)]  # fmt: skip
    for statistic, size in zip(STATISTICS, bins, strict=False):
        layout += [(f"{statistic}_counts", "q", size), (f"{statistic}_sums", "d", 5)]
    return layout


def _zero(array: memoryview) -> None:
    array[:] = memoryview(bytes(len(array) * array.itemsize)).cast(array.format)


def psi_terms(observed: Sequence[int], expected: Sequence[int]) -> list[float]:
    """Each bin's contribution to the population stability index (their sum is the PSI)."""
    return [(o - e) * math.log(o / e) for o, e in zip(shares(observed), shares(expected), strict=True)]


class DriftWindow:
    """The last `window` predictions, counted per class and per top-1 / margin bin.

    `add` is O(1) under the memory's lock (O(log bins) to bin top-1 and margin). The verdict has hysteresis: it
    turns `drift` when a statistic crosses its threshold and `ok` again only when every statistic is back under
    its recover level (RECOVER x a fixed threshold; the 90th percentile of test-like windows when calibrated), so
    a window that hovers at a threshold neither flaps between verdicts nor warns on every prediction;
    `on_change(verdict, report)` is called at each of the two turns, by the caller whose prediction turned it.
    Thread-safe: the server's streams call `add`. Its state (a ring of the window's predictions, the counts, the
    PSI sums, the verdict) lives in `memory` (tasks/release/window_memory.py): this process's by default, or a
    block every worker of a server maps, so that the window is the server's. Crash-safe: an update is journaled
    before it touches the window, and whoever takes the lock next after a worker died mid-update (kill -9 at
    any instruction) redoes it from the journal and recounts the window from its ring, so a reader never sees
    half an update and a dead writer never leaves one."""

    def __init__(self, classes: Sequence[str], reference: Reference | None, thresholds: DriftThresholds,
                 on_change: Callable[[str, dict[str, Any]], None] | None = None,
                 memory: WindowMemory | None = None) -> None:  # fmt: skip
        if thresholds.window > MAX_WINDOW:
            raise ValueError(f"drift window {thresholds.window} > {MAX_WINDOW}")
        self.classes, self.reference, self.thresholds = tuple(classes), reference, thresholds
        self._on_change = on_change
        self._memory = memory = memory or LocalMemory()
        self._closed = False
        bins = [len(reference.counts(s)) for s in STATISTICS] if reference else []
        self._arrays = state = memory.open(window_layout(len(self.classes), thresholds.window, bins))
        self._lock = memory.lock()
        self._ring, self._state = state["ring"], state["state"]  # state: head, filled, alert, since refresh
        self.total = state["total"]  # every prediction since start, by class
        self._classes, self._top1, self._margin = state["classes"], state["top1"], state["margin"]
        self._psi = [Psi(reference.counts(s), state[f"{s}_counts"], state[f"{s}_sums"])
                     for s in STATISTICS] if reference else []  # fmt: skip

    def add(self, index: int, top1: float, margin: float) -> None:
        ref = self.reference
        # bin 0 below the first inner edge, len(edges) at or above the last: as drift_reference._counts bins it
        t = bisect_right(ref.top1_edges, top1) if ref else 0
        m = bisect_right(ref.margin_edges, margin) if ref else 0
        changed = False
        state = self._state
        with self._lock:
            if self._closed:  # a request in flight when a reload replaced this model's window
                return
            self._recover()
            state[J_HEAD], state[J_FILLED], state[J_INDEX] = state[HEAD], state[FILLED], index
            state[J_T], state[J_M], state[J_TOTAL] = t, m, self.total[index]
            state[BEGUN] += 1  # journaled: from here a writer killed anywhere is redone by the next holder
            n = self._apply()
            if ref is not None and n >= self.thresholds.min_predictions:
                state[SINCE_REFRESH] += 1
                if state[SINCE_REFRESH] >= self.thresholds.window:
                    state[SINCE_REFRESH] = 0
                    for psi in self._psi:
                        psi.refresh()
                values = self._statistics()
                if not state[ALERT] and self.thresholds.exceeded(values, n):
                    state[ALERT], changed = 1, True
                elif state[ALERT] and self.thresholds.recovered(values, n):
                    state[ALERT], changed = 0, True
            alert = bool(state[ALERT])
            state[DONE] = state[BEGUN]
        if changed and self._on_change is not None:
            self._on_change(DRIFT if alert else OK, self.report())

    def _apply(self) -> int:
        """The journaled prediction into the ring and the counts (the oldest out once full); the new fill."""
        window, ring, state = self.thresholds.window, self._ring, self._state
        head, n, entry = state[J_HEAD], state[J_FILLED], (state[J_INDEX], state[J_T], state[J_M])
        slot = 3 * head
        oldest = (ring[slot], ring[slot + 1], ring[slot + 2]) if n == window else None
        ring[slot], ring[slot + 1], ring[slot + 2] = entry
        self.total[entry[0]] = state[J_TOTAL] + 1
        self._move(entry, 1)
        if oldest is not None:
            self._move(oldest, -1)
        n = min(n + 1, window)
        state[HEAD], state[FILLED] = (head + 1) % window, n
        return n

    def _recover(self) -> None:
        """Under the lock: an update a dead writer began and did not finish, redone from its journal; the counts
        and sums then recounted from the ring, whatever step it died at."""
        state, ring = self._state, self._ring
        if state[BEGUN] == state[DONE]:
            return
        window, head, n = self.thresholds.window, state[J_HEAD], state[J_FILLED]
        slot = 3 * head
        ring[slot], ring[slot + 1], ring[slot + 2] = state[J_INDEX], state[J_T], state[J_M]
        self.total[state[J_INDEX]] = state[J_TOTAL] + 1
        state[HEAD], state[FILLED] = (head + 1) % window, min(n + 1, window)
        for array in (self._classes, self._top1, self._margin, *(psi.counts for psi in self._psi)):
            _zero(array)
        for s in range(state[FILLED]):
            self._move((ring[3 * s], ring[3 * s + 1], ring[3 * s + 2]), 1)
        for psi in self._psi:
            psi.refresh()
        state[DONE] = state[BEGUN]
        log.warning("drift window: a worker stopped in the middle of an update; redone from its journal and "
                    "recounted from the window's %d predictions", state[FILLED])  # fmt: skip

    def restart(self, generation: int) -> bool:
        """An empty window, once per reload `generation` that (re)installs this model: a model that comes back
        (A -> B -> A) starts afresh, not from its old window and alarm. Every worker swapping to the model in the
        same generation calls it; the first empties the window, the rest find it started. True: emptied."""
        with self._lock:
            if self._state[STARTED] >= generation:
                return False
            for array in self._arrays.values():
                _zero(array)
            self._state[STARTED] = generation
            return True

    def close(self) -> None:
        """Let go of the memory (a shared block's mapping and descriptor); `add` does nothing after."""
        with self._lock:
            self._closed = True
            self._ring = self._state = self.total = self._classes = self._top1 = self._margin = None  # type: ignore[assignment]
            self._arrays, self._psi = {}, []
        self._memory.close()

    def _move(self, entry: tuple[int, int, int], by: int) -> None:
        index, t, m = entry
        self._classes[index] += by
        self._top1[t] += by
        self._margin[m] += by
        if self._psi:
            for psi, i in zip(self._psi, entry, strict=True):
                psi.change(i, by)

    @property
    def verdict(self) -> str:
        """The verdict now, as /drift gives it."""
        if self.reference is None:
            return NO_REFERENCE
        return self.thresholds.verdict(self.filled, bool(self._state[ALERT]))

    @property
    def filled(self) -> int:
        return self._state[FILLED]

    def values(self) -> dict[str, float] | None:
        """Each statistic's value now, or None without a reference."""
        if self.reference is None:
            return None
        with self._lock:
            self._recover()
            return self._statistics()

    def threshold(self, statistic: str) -> float:
        """A statistic's threshold at the window's fill now (at least min_predictions)."""
        return self.thresholds.of(statistic, max(self.filled, self.thresholds.min_predictions))

    def _statistics(self) -> dict[str, float]:
        n = self._state[FILLED]
        return {s: psi.value(n) for s, psi in zip(STATISTICS, self._psi, strict=True)}

    def report(self) -> dict[str, Any]:
        """What /drift answers: window, per-class shares, each statistic with its threshold, verdict."""
        th = self.thresholds
        with self._lock:
            self._recover()
            n, classes = self._state[FILLED], list(self._classes)
            top1, margin, total = list(self._top1), list(self._margin), list(self.total)
            values = self._statistics() if self.reference else None
            alert = bool(self._state[ALERT])
        ref = self.reference
        report: dict[str, Any] = {
            "window": {"size": th.window, "filled": n, "min_predictions": th.min_predictions},
            "predictions_total": dict(zip(self.classes, total, strict=True)),
        }
        if ref is None or values is None:
            return {"verdict": NO_REFERENCE, **report,
                    "detail": "the served model carries no drift reference (exported before drift references); "
                              "re-export it to watch drift"}  # fmt: skip
        observed = [c / n if n else 0.0 for c in classes]
        expected = [c / ref.num_samples for c in ref.class_counts]
        terms = psi_terms(classes, ref.class_counts)
        per_class = [{"class": name, "observed": round(o, 4), "expected": round(e, 4), "contribution": round(t, 4),
                      "count": c, "expected_count": r}
                     for name, o, e, t, c, r in zip(self.classes, observed, expected, terms, classes, ref.class_counts,
                                                    strict=True)]  # fmt: skip
        verdict, statistics = th.judge(values, n, alert)
        moved = sorted(per_class, key=lambda row: -abs(row["observed"] - row["expected"]))[:3]
        return {
            "verdict": verdict,
            **report,
            "hysteresis": "drift from a statistic over its threshold until every statistic is back under its "
            "recover level",
            "reference": {"split": ref.split, "num_samples": ref.num_samples},
            "statistics": statistics,
            "classes": per_class,
            "moved_most": [{"class": r["class"], "change": round(r["observed"] - r["expected"], 4)} for r in moved],
            "top1": {"edges": list(ref.top1_edges), "observed": top1, "expected": list(ref.top1_counts)},
            "margin": {"edges": list(ref.margin_edges), "observed": margin, "expected": list(ref.margin_counts)},
        }
