"""The serving path: an ONNX file (hash-verified) + image bytes or uint8 arrays -> logits, top-k, metrics.

`OnnxModel.load` checks the file's sha256 before onnxruntime sees a byte, then reads the
`PreprocessSpec` from the model's own metadata_props, so every caller (export checks, the
regression gate, the nightly flow, serving) preprocesses exactly as training did. No side effects
at import; safe to use from Prefect tasks and web servers.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from pydantic import ValidationError

from tasks.core.blocks import batches
from tasks.images.imaging import PreprocessSpec, load_array, normalize_array

if TYPE_CHECKING:  # onnxruntime loads when a session is made: a gate that reuses its scores needs none
    import onnxruntime as ort

SPEC_KEY = "preprocess_spec"
CLASS_NAMES_KEY = "class_names"


class ModelIntegrityError(RuntimeError):
    """The model file is not the one that was checked: its sha256 differs from the recorded one."""


class ModelMetadataError(ValueError):
    """The model file lacks the preprocessing spec (or carries one that does not validate)."""


@dataclass(frozen=True)
class Prediction:
    index: int
    label: str
    probability: float


def verify_sha256(path: Path, data: bytes, expected_sha256: str | None) -> str:
    """sha256 of `data`; raises ModelIntegrityError naming the file when it is not `expected_sha256`."""
    actual = hashlib.sha256(data).hexdigest()
    if expected_sha256 is not None and actual != expected_sha256.lower():
        raise ModelIntegrityError(
            f"{path}: sha256 {actual} does not match the recorded {expected_sha256}; "
            "the file was altered or replaced after it was checked, refusing to load it"
        )
    return actual


def spec_from_metadata(metadata: Mapping[str, str], source: str) -> PreprocessSpec:
    if SPEC_KEY not in metadata:
        raise ModelMetadataError(f"{source}: no '{SPEC_KEY}' in the model metadata; export it with tasks.export")
    try:
        spec = PreprocessSpec.model_validate_json(metadata[SPEC_KEY])
    except ValidationError as exc:
        raise ModelMetadataError(f"{source}: metadata '{SPEC_KEY}' is not a valid spec: {exc}") from None
    if CLASS_NAMES_KEY in metadata and tuple(json.loads(metadata[CLASS_NAMES_KEY])) != spec.class_names:
        raise ModelMetadataError(f"{source}: metadata '{CLASS_NAMES_KEY}' disagrees with the spec's class names")
    return spec


def session_options(threads: int) -> ort.SessionOptions:
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return options


@dataclass(frozen=True)
class OnnxModel:
    """An onnxruntime session over verified bytes, with the spec and class names the file carries."""

    path: Path
    sha256: str
    spec: PreprocessSpec
    metadata: dict[str, str]
    session: ort.InferenceSession

    @classmethod
    def load(cls, path: Path, *, expected_sha256: str | None = None, threads: int = 0) -> OnnxModel:
        """Read the file once, verify its hash, then build the session from those same bytes.

        `threads`: onnxruntime intra-op threads (0 = onnxruntime's default, one per core).
        """
        path = Path(path)
        data = path.read_bytes()
        digest = verify_sha256(path, data, expected_sha256)
        import onnxruntime as ort

        session = ort.InferenceSession(data, session_options(threads), providers=["CPUExecutionProvider"])
        metadata = dict(session.get_modelmeta().custom_metadata_map)
        return cls(path, digest, spec_from_metadata(metadata, str(path)), metadata, session)

    @property
    def class_names(self) -> tuple[str, ...]:
        return self.spec.class_names

    def forward(self, batch: np.ndarray) -> np.ndarray:
        """float32 normalised (N, 3, S, S) -> logits (N, classes)."""
        name = self.session.get_inputs()[0].name
        return self.session.run(None, {name: np.ascontiguousarray(batch, dtype=np.float32)})[0]

    def normalize(self, images: np.ndarray) -> np.ndarray:
        """uint8 (N, 3, S, S) -> float32, with the same function training used and this model's mean/std."""
        return normalize_array(images, self.spec)

    def logits(self, images: np.ndarray | Iterable[np.ndarray], batch_size: int = 256) -> np.ndarray:
        """uint8 (N, 3, S, S) at the spec's size, or its rows in blocks (a split streamed: ShardSplit.blocks, the
        same batches whatever the blocks) -> float32 logits (N, classes)."""
        if isinstance(images, np.ndarray):
            self._check(images)
        outputs = [self.forward(self.normalize(self._check(batch))) for batch in batches(images, batch_size)]
        return np.concatenate(outputs) if outputs else np.zeros((0, len(self.class_names)), np.float32)

    def _check(self, images: np.ndarray) -> np.ndarray:
        size = self.spec.image_size
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != (3, size, size):
            raise ValueError(f"expected uint8 (N, 3, {size}, {size}) images, got {images.dtype} {images.shape}")
        return images

    def preprocess(self, data: bytes) -> np.ndarray:
        """Image bytes -> uint8 (3, S, S), exactly as the preprocess stage made the training shards."""
        return load_array(data, self.spec)

    def predict(self, data: bytes, top_k: int = 5) -> list[Prediction]:
        """Image bytes -> the top-k classes with softmax probabilities, most likely first."""
        probs = softmax(self.logits(self.preprocess(data)[None]))[0]
        return [Prediction(int(i), self.class_names[i], float(probs[i])) for i in ranked(probs)[: max(1, top_k)]]


def softmax(logits: np.ndarray) -> np.ndarray:
    """Logits (N, classes) -> probabilities (N, classes), in float64, each row summing to 1."""
    logits = np.asarray(logits, dtype=np.float64)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    return probs / probs.sum(axis=1, keepdims=True)


def ranked(probs: np.ndarray) -> np.ndarray:
    """The class indices of one row of probabilities, most likely first (ties: lower index first)."""
    return np.argsort(-probs, kind="stable")


def median_latency_ms(runners: Mapping[str, Callable[[], object]], repeats: int, warmup: int = 3) -> dict[str, float]:
    """Median wall time of each runner in milliseconds, measured side by side.

    Runners are interleaved (one call of each per round), so load from other processes on a shared
    machine slows all of them alike instead of whichever happened to run during the noise.
    """
    for run in runners.values():
        for _ in range(warmup):
            run()
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: round(float(np.median(values)) * 1000, 3) for name, values in times.items()}
