"""An ONNX file's metadata_props, written so the same model gives the same bytes from any checkout (no torch),
and the temperature its logits carry."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import onnx

STACK_TRACE = "pkg.torch.onnx.stack_trace"  # per-node source locations the dynamo exporter records
# The graph's logits are the trained model's divided by this (tasks/training/temperature.py); "1.0": not scaled.
# A softmax of the output is then the calibrated probability: the server's, its review threshold's and drift's.
TEMPERATURE_KEY = "temperature"


def write_metadata(path: Path, metadata: dict[str, str]) -> None:
    """Replace the ONNX file's metadata_props with `metadata` (sorted, so the bytes are stable), and
    drop the exporter's per-node stack traces: they hold absolute paths of this checkout's venv, so
    the same model exported from another folder would get other bytes (and another md5 in dvc.lock)."""
    proto = onnx.load(str(path))
    del proto.metadata_props[:]
    for key, value in sorted(metadata.items()):
        proto.metadata_props.add(key=key, value=value)
    for node in _all_nodes(proto):
        kept = [prop for prop in node.metadata_props if prop.key != STACK_TRACE]
        if len(kept) != len(node.metadata_props):
            del node.metadata_props[:]
            node.metadata_props.extend(kept)
    onnx.save(proto, str(path))


def _all_nodes(proto: onnx.ModelProto) -> Iterator[onnx.NodeProto]:
    graphs = [proto.graph]
    functions = list(proto.functions)
    while graphs or functions:
        nodes = graphs.pop().node if graphs else functions.pop().node
        for node in nodes:
            yield node
            for attribute in node.attribute:
                graphs += [attribute.g] if attribute.HasField("g") else []
                graphs += list(attribute.graphs)
