"""Prometheus metrics of one app instance, and the review folder of low-confidence inputs.

Predictions (top-1 probability, margin) -> histograms; inputs under the confidence threshold ->
`<review_dir>/<predicted class>/<sha256>.<ext>` + a `.json` sidecar, an ImageFolder that
`data.source` can take in once a person has moved each image to its true class.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PIL import Image
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tasks.core.io import atomic_file
from tasks.images.imaging import IMAGE_SUFFIXES, is_image_name
from tasks.release.drift import DRIFT, STATISTICS, VERDICTS, DriftWindow

log = logging.getLogger("serving")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
_PROB_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)


class Metrics:
    """One registry per app, so several apps (tests) never share counters."""

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
        self.drift_statistic = Gauge("serve_drift_statistic", "drift statistic of this worker's window (GET /drift)",
                                     ["statistic"], registry=r)  # fmt: skip
        self.drift_threshold = Gauge("serve_drift_threshold", "threshold of each drift statistic", ["statistic"],
                                     registry=r)  # fmt: skip
        self.drift_verdict = Gauge("serve_drift_verdict", "1 for this worker's drift verdict now", ["verdict"],
                                   registry=r)  # fmt: skip
        self.drift_window = Gauge("serve_drift_window_filled", "predictions in this worker's drift window", registry=r)
        self.ready = Gauge("serve_ready", "1 once the model is loaded and warm", registry=r)
        self.model = Gauge("serve_model_info", "the served model", ["sha256", "source"], registry=r)
        self.streams = Gauge("serve_streams", "inference streams (calls that run at once)", registry=r)
        self.streams_busy = Gauge("serve_streams_busy", "streams running a call now", registry=r)
        self.queue_depth = Gauge("serve_queue_depth", "images waiting for a free stream", registry=r)
        self.batch_size = Histogram("serve_batch_size", "uploads per inference call (dynamic batching)",
                                    buckets=_BATCH_BUCKETS, registry=r)  # fmt: skip

    def watch_drift(self, window: Callable[[], DriftWindow | None]) -> None:
        """The drift gauges, read from the window (None until the model loads) when Prometheus scrapes:
        nothing per prediction. A threshold is the one in force at the window's fill now (calibrated ones
        depend on it)."""

        def value(statistic: str) -> float:
            drift = window()
            values = drift.values() if drift else None
            return values[statistic] if values else math.nan

        def threshold(statistic: str) -> float:
            drift = window()
            return drift.threshold(statistic) if drift else math.nan

        def verdict_is(verdict: str) -> float:
            drift = window()
            return float(drift is not None and drift.verdict == verdict)

        for statistic in STATISTICS:
            self.drift_statistic.labels(statistic=statistic).set_function(lambda s=statistic: value(s))
            self.drift_threshold.labels(statistic=statistic).set_function(lambda s=statistic: threshold(s))
        for verdict in VERDICTS:
            self.drift_verdict.labels(verdict=verdict).set_function(lambda v=verdict: verdict_is(v))
        self.drift_window.set_function(lambda: drift.filled if (drift := window()) else 0)


def log_drift(verdict: str, report: dict[str, Any]) -> None:
    """Once when this worker's window turns to drift, once when every statistic is back under its recover level."""
    n = report["window"]["filled"]
    stats = ", ".join(
        f"{name} {s['value']:.3f} (threshold {s['threshold']}, recover under {s['recover']})"
        for name, s in report["statistics"].items()
    )
    moved = ", ".join(f"{m['class']} {m['change']:+.1%}" for m in report["moved_most"])
    if verdict == DRIFT:
        log.warning("drift in the last %d predictions of worker %d: %s; moved most: %s (GET /drift)",
                    n, os.getpid(), stats, moved)  # fmt: skip
    else:
        log.warning("drift over: the last %d predictions of worker %d are back under every recover level: %s",
                    n, os.getpid(), stats)  # fmt: skip


def image_suffix(data: bytes) -> str | None:
    """The suffix preprocess recognises for these bytes' format (header only), or None."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            fmt = (img.format or "").lower()
    except Exception:  # untrusted bytes: any failure means "not saveable"
        return None
    suffix = {"jpeg": ".jpg", "tiff": ".tif", "mpo": ".jpg"}.get(fmt, f".{fmt}")
    return suffix if suffix in IMAGE_SUFFIXES else None


class ReviewFolder:
    """Bounded store of low-confidence inputs: at most `max_files` images of at most `max_file_bytes` each."""

    def __init__(self, root: Path, max_files: int, max_file_bytes: int) -> None:
        self.root, self.max_files, self.max_file_bytes = root, max_files, max_file_bytes
        self._lock = threading.Lock()
        self._count = self._images()

    @property
    def count(self) -> int:
        return self._count

    def recount(self) -> int:
        """The images in the folder now: `make add-data SRC=<review folder> INTO=...` takes them out while the
        server runs, and a person may delete some."""
        with self._lock:
            self._count = self._images()
            return self._count

    def _images(self) -> int:
        """Images still to review: a hidden folder's (the review page's .discarded/) are decided, not counted."""
        if not self.root.is_dir():
            return 0
        return sum(1 for p in self.root.rglob("*") if p.is_file() and is_image_name(p)
                   and not any(part.startswith(".") for part in p.relative_to(self.root).parts))  # fmt: skip

    def save(self, data: bytes, sha256: str, label: str, record: dict[str, Any]) -> str | None:
        """Write the image and its sidecar (temp + rename); returns why not when it was skipped."""
        if len(data) > self.max_file_bytes:
            return "too_large"
        suffix = image_suffix(data)
        if suffix is None:
            return "unknown_format"
        folder = self.root / label
        target = folder / f"{sha256}{suffix}"
        with self._lock:
            if target.exists():
                return "duplicate"
            if self._count >= self.max_files:
                return "full"
            self._count += 1
        folder.mkdir(parents=True, exist_ok=True)
        sidecar = target.with_suffix(".json")
        # Time belongs in the sidecar: the review folder is intake, not a versioned artifact.
        payload = {**record, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        for path, content in ((sidecar, json.dumps(payload, indent=2).encode()), (target, data)):
            with atomic_file(path, durable=False) as handle:  # the image last: an image always has its sidecar
                handle.write(content)
        return None
