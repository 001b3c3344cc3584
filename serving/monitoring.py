"""Prometheus metrics of one app instance, and the server's drift window as Prometheus gauges and log lines.

Predictions (top-1 probability, margin) -> histograms; every worker's counters summed under
multiprocess mode. The review folder of low-confidence inputs is serving/review_store.py.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

from serving.runtime import MULTIPROCESS_ENV
from tasks.release.drift import DRIFT, STATISTICS, VERDICTS, DriftWindow

log = logging.getLogger("serving")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
_PROB_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)


def multiprocess() -> bool:
    """prometheus_client keeps every metric in a file per worker, summed by /metrics. It reads the variable
    when imported, so it is set before the workers start."""
    return MULTIPROCESS_ENV in os.environ


class Metrics:
    """One registry per app, so several apps (tests) never share counters. Under `python -m serving` the values
    live in prometheus_client's multiprocess folder, and /metrics sums every worker's (`exposition`); a gauge
    says how its workers' values combine (livesum: over the live workers)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("serve_requests", "HTTP requests", ["endpoint", "code"], registry=r)
        self.latency = Histogram(
            "serve_request_latency_seconds", "request latency", ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.errors = Counter("serve_errors", "4xx/5xx responses by code and reason", ["code", "reason"], registry=r)
        self.predictions = Counter("serve_predictions", "images classified", registry=r)
        self.top1 = Histogram("serve_top1_probability", "top-1 probability", buckets=_PROB_BUCKETS, registry=r)
        self.margin = Histogram("serve_top1_margin", "top-1 minus top-2 probability", buckets=_PROB_BUCKETS, registry=r)
        self.low_confidence = Counter("serve_low_confidence", "predictions under serve.low_confidence", registry=r)
        self.review_saved = Counter("serve_review_saved", "low-confidence inputs saved for review", registry=r)
        self.review_skipped = Counter("serve_review_skipped", "low-confidence inputs not saved", ["why"], registry=r)
        self.predicted_class = Counter("serve_predicted_class", "predictions by top-1 class", ["label"], registry=r)
        self.ready = Gauge("serve_ready", "1 once the model is loaded and warm (every worker)", registry=r,
                           multiprocess_mode="livemin")  # fmt: skip
        self.model = Gauge("serve_model_info", "the served model: the workers serving it", ["sha256", "source"],
                           registry=r, multiprocess_mode="livesum")  # fmt: skip
        self.streams = Gauge("serve_streams", "inference streams (calls that run at once), all workers", registry=r,
                             multiprocess_mode="livesum")  # fmt: skip
        self.streams_busy = Gauge("serve_streams_busy", "streams running a call now", registry=r,
                                  multiprocess_mode="livesum")  # fmt: skip
        self.queue_depth = Gauge("serve_queue_depth", "images waiting for a free stream", registry=r,
                                 multiprocess_mode="livesum")  # fmt: skip
        self.batch_size = Histogram("serve_batch_size", "uploads per inference call (dynamic batching)",
                                    buckets=_BATCH_BUCKETS, registry=r)  # fmt: skip
        self._served: dict[str, str] | None = None
        self._drift: DriftCollector | None = None

    def load(self, queue_depth: int, busy: int) -> None:
        """The batcher's queue and busy streams, set as they change (a gauge computed at scrape time would be the
        scraping worker's only)."""
        self.queue_depth.set(queue_depth)
        self.streams_busy.set(busy)

    def serving(self, sha256: str, source: str) -> None:
        """This worker serves `sha256` now: its model gauge moves from the previous one (kept at 0, since another
        worker's file may still count it) and it is ready."""
        if self._served is not None:
            self.model.labels(**self._served).set(0)
        self._served = {"sha256": sha256, "source": source}
        self.model.labels(**self._served).set(1)
        self.ready.set(1)

    def watch_drift(self, window: Callable[[], DriftWindow | None]) -> None:
        """The drift gauges, read from the window (None until the model loads) when Prometheus scrapes: nothing
        per prediction. The window is the server's (serving/shared_memory.py), so any worker answers for all."""
        self._drift = DriftCollector(window)
        if not multiprocess():
            self.registry.register(self._drift)

    def exposition(self) -> bytes:
        """The Prometheus text of this app: every worker's values summed under `python -m serving`."""
        if not multiprocess():
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        if self._drift is not None:
            registry.register(self._drift)
        return generate_latest(registry)

    def close(self) -> None:
        """This worker exits: its live gauges leave the sums."""
        if multiprocess():
            mark_process_dead(os.getpid())


class DriftCollector(Collector):
    """serve_drift_* gauges from the window at scrape time. A threshold is the one in force at the window's fill
    now (calibrated ones depend on it)."""

    def __init__(self, window: Callable[[], DriftWindow | None]) -> None:
        self._window = window

    def collect(self) -> Iterator[GaugeMetricFamily]:
        drift = self._window()
        values = drift.values() if drift else None
        statistic = GaugeMetricFamily("serve_drift_statistic", "drift statistic of the server's window (GET /drift)",
                                      labels=["statistic"])  # fmt: skip
        threshold = GaugeMetricFamily("serve_drift_threshold", "threshold of each drift statistic",
                                      labels=["statistic"])  # fmt: skip
        for name in STATISTICS:
            statistic.add_metric([name], values[name] if values else math.nan)
            threshold.add_metric([name], drift.threshold(name) if drift else math.nan)
        verdict = GaugeMetricFamily("serve_drift_verdict", "1 for the server's drift verdict now", labels=["verdict"])
        for name in VERDICTS:
            verdict.add_metric([name], float(drift is not None and drift.verdict == name))
        filled = GaugeMetricFamily("serve_drift_window_filled", "predictions in the server's drift window",
                                   value=drift.filled if drift else 0)  # fmt: skip
        yield from (statistic, threshold, verdict, filled)


def log_drift(verdict: str, report: dict[str, Any]) -> None:
    """Once when the server's window turns to drift, once when every statistic is back under its recover level:
    logged by the worker whose prediction turned it."""
    n = report["window"]["filled"]
    stats = ", ".join(
        f"{name} {s['value']:.3f} (threshold {s['threshold']}, recover under {s['recover']})"
        for name, s in report["statistics"].items()
    )
    moved = ", ".join(f"{m['class']} {m['change']:+.1%}" for m in report["moved_most"])
    if verdict == DRIFT:
        log.warning("drift in the last %d predictions of the server (seen by worker %d): %s; moved most: %s "
                    "(GET /drift)", n, os.getpid(), stats, moved)  # fmt: skip
    else:
        log.warning("drift over: the server's last %d predictions are back under every recover level (seen by "
                    "worker %d): %s", n, os.getpid(), stats)  # fmt: skip
