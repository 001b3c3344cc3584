"""The trained torch model -> files: ONNX (dynamo, dynamic batch, one file) and a byte-stable TorchScript archive."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path

import torch

from tasks.core.environment import usable_cores
from tasks.images.imaging import PreprocessSpec

INPUT_NAME, OUTPUT_NAME = "input", "logits"  # the ONNX graph's input and output
TORCHSCRIPT_METADATA = "metadata.json"  # an _extra_files entry: the same key/values as the ONNX metadata_props


@contextlib.contextmanager
def quiet_loggers(*names: str, level: int = logging.WARNING) -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in names]
    before = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(level)
    try:
        yield
    finally:
        for logger, old in zip(loggers, before, strict=True):
            logger.setLevel(old)


def export_onnx(model: torch.nn.Module, spec: PreprocessSpec, path: Path, opset: int) -> None:
    """torch.onnx (dynamo) export with a dynamic batch axis, saved as one file (no external data)."""
    example = torch.zeros(2, 3, spec.image_size, spec.image_size)
    with warnings.catch_warnings(), quiet_loggers("onnx_ir", "onnxscript"):  # per-pass INFO chatter
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model.eval(),
            (example,),
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_shapes={"x": {0: torch.export.Dim("batch")}},
            opset_version=opset,
            dynamo=True,
            verbose=False,
        )
    program.save(str(path), external_data=False)


def export_torchscript(model: torch.nn.Module, spec: PreprocessSpec, path: Path, metadata: dict[str, str]) -> None:
    """torch.jit.trace, saved as a byte-stable archive with `metadata` as an extra file."""
    example = torch.zeros(2, 3, spec.image_size, spec.image_size)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit is deprecated in favour of torch.export, still supported
        traced = torch.jit.trace(model.eval(), example)
        torch.jit.save(traced, buffer, _extra_files={TORCHSCRIPT_METADATA: json.dumps(metadata, sort_keys=True)})
    path.write_bytes(stable_archive(buffer.getvalue()))


def stable_archive(data: bytes) -> bytes:
    """torch.jit.save's zip without what changes from run to run: the *.debug_pkl source locations
    (they hold the caller's absolute path) and the random .data/serialization_id. Loading needs neither."""
    source, out = zipfile.ZipFile(io.BytesIO(data)), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for info in source.infolist():
            if not info.filename.endswith((".debug_pkl", ".data/serialization_id")):
                archive.writestr(zipfile.ZipInfo(info.filename, date_time=(1980, 1, 1, 0, 0, 0)), source.read(info))
    return out.getvalue()


def load_torchscript(path: Path) -> tuple[torch.jit.ScriptModule, dict[str, str]]:
    extra = {TORCHSCRIPT_METADATA: ""}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = torch.jit.load(str(path), map_location="cpu", _extra_files=extra)
    return module.eval(), json.loads(extra[TORCHSCRIPT_METADATA])


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads or usable_cores())
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
