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

import math
from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import Any

from tasks.release.calibration import SHARE_FLOOR, STATISTICS, Psi, shares
from tasks.release.drift_reference import Reference
from tasks.release.drift_thresholds import DriftThresholds
from tasks.release.window_memory import Layout, LocalMemory, WindowMemory

MAX_WINDOW = round(1 / SHARE_FLOOR)  # up to here an observed bin with a count is never under the floor (O(1) PSI)
OK, DRIFT, NOT_ENOUGH, NO_REFERENCE = "ok", "drift", "not enough data", "no reference"
VERDICTS = (OK, DRIFT, NOT_ENOUGH, NO_REFERENCE)


HEAD, FILLED, ALERT, SINCE_REFRESH = range(4)  # the window's `state` cells


def window_layout(classes: int, window: int, bins: Sequence[int]) -> Layout:
    """A window's arrays: the ring of its predictions (class, top-1 bin, margin bin), its state cells, the counts
    by class since start and in the window, the top-1 and margin bins, and each statistic's PSI counts and sums
    (`bins`: each statistic's bin count; none without a reference)."""
    layout = [("ring", "q", 3 * window), ("state", "q", 4), ("total", "q", classes), ("classes", "q", classes),
              ("top1", "q", bins[1] if bins else 1), ("margin", "q", bins[2] if bins else 1)]  # fmt: skip
    for statistic, size in zip(STATISTICS, bins, strict=False):
        layout += [(f"{statistic}_counts", "q", size), (f"{statistic}_sums", "d", 5)]
    return layout


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
    block every worker of a server maps, so that the window is the server's."""

    def __init__(self, classes: Sequence[str], reference: Reference | None, thresholds: DriftThresholds,
                 on_change: Callable[[str, dict[str, Any]], None] | None = None,
                 memory: WindowMemory | None = None) -> None:  # fmt: skip
        if thresholds.window > MAX_WINDOW:
            raise ValueError(f"drift window {thresholds.window} > {MAX_WINDOW}")
        self.classes, self.reference, self.thresholds = tuple(classes), reference, thresholds
        self._on_change = on_change
        memory = memory or LocalMemory()
        bins = [len(reference.counts(s)) for s in STATISTICS] if reference else []
        state = memory.open(window_layout(len(self.classes), thresholds.window, bins))
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
        window, ring, state = self.thresholds.window, self._ring, self._state
        with self._lock:
            self.total[index] += 1
            head, n = state[HEAD], state[FILLED]
            slot = 3 * head
            oldest = (ring[slot], ring[slot + 1], ring[slot + 2]) if n == window else None
            ring[slot], ring[slot + 1], ring[slot + 2] = index, t, m
            self._move((index, t, m), 1)
            if oldest is not None:
                self._move(oldest, -1)
            n = min(n + 1, window)
            state[HEAD], state[FILLED] = (head + 1) % window, n
            if ref is None or n < self.thresholds.min_predictions:
                return
            state[SINCE_REFRESH] += 1
            if state[SINCE_REFRESH] >= window:
                state[SINCE_REFRESH] = 0
                for psi in self._psi:
                    psi.refresh()
            values = self._statistics()
            if not state[ALERT] and self.thresholds.exceeded(values, n):
                state[ALERT], changed = 1, True
            elif state[ALERT] and self.thresholds.recovered(values, n):
                state[ALERT], changed = 0, True
            alert = bool(state[ALERT])
        if changed and self._on_change is not None:
            self._on_change(DRIFT if alert else OK, self.report())

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
        if self.filled < self.thresholds.min_predictions:
            return NOT_ENOUGH
        return DRIFT if self._state[ALERT] else OK

    @property
    def filled(self) -> int:
        return self._state[FILLED]

    def values(self) -> dict[str, float] | None:
        """Each statistic's value now, or None without a reference."""
        if self.reference is None:
            return None
        with self._lock:
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
        at = max(n, th.min_predictions)
        verdict = NOT_ENOUGH if n < th.min_predictions else DRIFT if alert else OK
        over = th.exceeded(values, at) if verdict != NOT_ENOUGH else []
        statistics = {s: {"value": round(values[s], 4), "threshold": round(th.of(s, at), 4), "exceeded": s in over,
                          "recover": round(th.limits[s].recover_at(at), 4), "source": th.limits[s].source,
                          "curve": [th.limits[s].a, th.limits[s].b]}
                      for s in STATISTICS}  # fmt: skip
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
