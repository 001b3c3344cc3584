"""INT8 by onnxruntime static quantization: fp32 ONNX + a seeded sample of training images -> INT8 ONNX.

QOperator format, u8 activations / s8 weights, MinMax ranges calibrated on the sample, after
`quant_pre_process`: the combination docs/benchmarks.md measured fastest on this CPU (static QDQ and
dynamic quantization were slower than fp32 there). The classifier head can stay fp32: on the
default data, quantizing it alone flipped 3.4% of top-1 predictions (agreement 0.966 vs 0.997
with the head in fp32, same speed-up).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
from onnxruntime.quantization.shape_inference import quant_pre_process

from tasks.images.shards import ShardSplit

CALIBRATION_BATCH = 32


def calibration_sample(shard_dir: Path, count: int, seed: int, split: str = "train") -> np.ndarray:
    """`count` images of `split` (all of them when fewer), drawn by `seed`, in index order: uint8 (N, 3, S, S)."""
    data = ShardSplit.open(shard_dir, split)
    rng = np.random.default_rng(seed)
    picked = np.sort(rng.choice(len(data), size=min(count, len(data)), replace=False))
    return data.take(picked)


class _Batches(CalibrationDataReader):
    """Feeds normalised calibration batches to the calibrator, once."""

    def __init__(self, input_name: str, batches: list[np.ndarray]) -> None:
        self._feeds = iter([{input_name: batch} for batch in batches])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._feeds, None)


def head_node(path: Path) -> str:
    """The name of the last Gemm/MatMul of the graph: the classifier head of a torchvision model."""
    nodes = [n.name for n in onnx.load(str(path)).graph.node if n.op_type in ("Gemm", "MatMul")]
    if not nodes:
        raise ValueError(f"{path}: no Gemm/MatMul node to keep in fp32 (export.int8.keep_head_fp32)")
    return nodes[-1]


def quantize_int8(
    fp32_path: Path,
    int8_path: Path,
    calibration: np.ndarray,
    *,
    input_name: str,
    per_channel: bool,
    keep_head_fp32: bool = True,
) -> None:
    """Write a static INT8 (QOperator, u8/s8) model; `calibration` is normalised float32 (N, 3, S, S)."""
    if len(calibration) == 0:
        raise ValueError("INT8 calibration needs at least one image")
    batches = [
        np.ascontiguousarray(calibration[i : i + CALIBRATION_BATCH], dtype=np.float32)
        for i in range(0, len(calibration), CALIBRATION_BATCH)
    ]
    # onnxruntime.quantization logs advice at WARNING through the root logger; keep stage logs readable.
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with tempfile.TemporaryDirectory(prefix="quantize-") as tmp:
            prepared = Path(tmp) / "prepared.onnx"
            quant_pre_process(str(fp32_path), str(prepared))
            exclude = [head_node(prepared)] if keep_head_fp32 else []
            quantize_static(
                str(prepared),
                str(int8_path),
                _Batches(input_name, batches),
                quant_format=QuantFormat.QOperator,
                activation_type=QuantType.QUInt8,
                weight_type=QuantType.QInt8,
                per_channel=per_channel,
                nodes_to_exclude=exclude,
            )
    finally:
        root.setLevel(level)
