"""The model slot: the model a worker serves, with its drift window and identity, loaded and swapped as one.

`prepare` resolves the production model (hash-verified), warms it up and builds its drift window; `load` does
that in the background at start (a failure is kept for /ready and the log, the process stays up for /health);
`install` swaps a prepared model into the slot, which POST /reload also uses. The classifier takes the model
and its window together (`ModelSlot.snapshot`), so a reload never splits them.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from serving.monitoring import Metrics, log, log_drift
from serving.schema import ModelInfo
from serving.shared_memory import SharedFile
from tasks.core.params import Paths, ServeParams
from tasks.release.drift import DriftWindow
from tasks.release.drift_reference import Reference
from tasks.release.drift_thresholds import DriftThresholds
from tasks.release.inference import OnnxModel
from tasks.release.production import ProductionModel, production_model


@dataclass
class ModelSlot:
    model: OnnxModel | None = None
    source: ProductionModel | None = None
    error: str | None = None
    info: dict[str, str] | None = None  # ModelInfo of the loaded model, as every response carries it
    drift: DriftWindow | None = None  # the server's last serve.drift.window predictions vs the model's reference
    lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self) -> tuple[OnnxModel, DriftWindow]:
        """The model and its drift window, taken together (a reload swaps both at once)."""
        with self.lock:
            assert self.model is not None and self.drift is not None
            return self.model, self.drift

    def swap(self, loaded: Loaded) -> None:
        with self.lock:
            self.model, self.source, self.drift, self.info = loaded.model, loaded.source, loaded.drift, loaded.info
            self.error = None


@dataclass(frozen=True)
class Loaded:
    model: OnnxModel
    source: ProductionModel
    drift: DriftWindow
    info: dict[str, str]


def prepare(serve: ServeParams, paths: Paths, shared: Path) -> Loaded:
    """The production model (hash-verified, warm) with its drift window; raises when it cannot be had. The
    window is the server's: a block in `shared` (its runtime folder's) that every worker serving this model
    maps (serving/shared_memory.py)."""
    source = production_model(paths)
    model = source.load(serve.threads)
    reference = Reference.from_metadata(model.metadata, model.class_names, str(source.path))
    size = model.spec.image_size
    largest = sorted({serve.max_batch, serve.max_batch_files}) if serve.warmup_runs else []
    for batch in [1] * serve.warmup_runs + largest:
        model.logits(np.zeros((batch, 3, size, size), np.uint8))
    release_freed_memory()
    thresholds, warnings = DriftThresholds.resolve(serve.drift, reference)
    if reference is None:
        log.warning("%s carries no drift reference (exported before drift references): /drift says 'no reference'; "
                    "re-export it to watch drift", source.path)  # fmt: skip
    for warning in warnings:
        log.warning("%s: %s", source.path, warning)
    sha = model.sha256
    info = ModelInfo(sha256=sha, source=source.source, version=f"{source.source}-{sha[:12]}").model_dump()
    memory = SharedFile(shared / f"drift-{sha}.window")
    return Loaded(model, source, DriftWindow(model.class_names, reference, thresholds, log_drift, memory), info)


def load(slot: ModelSlot, serve: ServeParams, paths: Paths, metrics: Metrics, shared: Path) -> None:
    try:
        loaded = prepare(serve, paths, shared)
    except Exception as exc:  # reported by /ready and the log; the process stays up for /health
        slot.error = f"{type(exc).__name__}: {exc}"
        log.error("model not loaded: %s", slot.error)
        return
    install(slot, loaded, metrics)


def install(slot: ModelSlot, loaded: Loaded, metrics: Metrics) -> None:
    slot.swap(loaded)
    metrics.serving(loaded.model.sha256, loaded.source.source)
    log.info("serving %s (%s, sha256 %s), warm", loaded.source.path, loaded.source.source, loaded.model.sha256)


def release_freed_memory() -> None:
    """Hand the heap that loading freed (the file's bytes, onnxruntime's load-time copies) back to the OS.

    glibc keeps it otherwise: about 80 MiB of RSS for a 43 MB resnet18."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL(None).malloc_trim(0)
