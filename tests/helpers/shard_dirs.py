"""Shard directories written straight from arrays (ShardFile, the stage's writer, and a manifest; no preprocess),
of any size and fast, and two tiny models over them (torch, ONNX): for the tests and the bench of what a pass over
a split holds in memory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from tasks.core.io import write_json
from tasks.images.imaging import PreprocessSpec
from tasks.images.shards import FORMAT_VERSION, MANIFEST, ShardFile, load_manifest

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def write_shard_dir(out: Path, counts: Mapping[str, int], *, image_size: int, classes: int = 3,
                    shard_rows: int = 500, seed: int = 0) -> PreprocessSpec:  # fmt: skip
    """`counts[split]` random uint8 images per split in shards of `shard_rows`, labels cycling through the classes,
    and a manifest listing each image as preprocess would (split, index, label, root, path, sha256); the spec."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    spec = PreprocessSpec(image_size=image_size, mean=MEAN, std=STD, class_names=tuple(f"c{i}" for i in range(classes)))
    splits, files = {}, []
    for split, count in counts.items():
        shards = []
        for number, start in enumerate(range(0, count, shard_rows)):
            rows = np.arange(start, min(start + shard_rows, count))
            labels = (rows % classes).astype(np.int16)
            images = rng.integers(0, 256, (len(rows), 3, image_size, image_size), dtype=np.uint8)
            shard = ShardFile(out / f"{split}-{number:05d}.arrow", image_size=image_size)
            for image, label in zip(images, labels, strict=True):
                shard.add(image, int(label))
            shards.append(shard.close())
            files += [{"split": split, "index": int(i), "label": int(i % classes), "root": "images",
                       "path": f"c{i % classes}/{split}-{i:06d}.png",
                       "sha256": hashlib.sha256(f"{split}/{i}".encode()).hexdigest()} for i in rows]  # fmt: skip
        splits[split] = {"count": count, "shards": shards}
    write_json(out / MANIFEST, {"format_version": FORMAT_VERSION, "image_size": image_size,
                                "class_names": list(spec.class_names), "spec": spec.model_dump(mode="json"),
                                "splits": splits, "files": files})  # fmt: skip
    return spec


def spec_of(shards: Path) -> PreprocessSpec:
    """The spec a shard directory's manifest records (what a model made on it carries)."""
    return PreprocessSpec.model_validate(load_manifest(shards)["spec"])


def write_dynamics(path: Path, train_images: int) -> Path:
    """A train_dynamics.json for `train_images` images, every one drawn once (evaluate's label-error pass reads it)."""
    write_json(path, {"rule": "synthetic", "aum": [0.0] * train_images, "p_given": [0.5] * train_images,
                      "times_trained": [1] * train_images})  # fmt: skip
    return path


def tiny_net(classes: int, seed: int = 0) -> torch.nn.Module:
    """A pool to 8 x 8, a conv and a linear head: logits in microseconds an image, whatever the image size."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.AdaptiveAvgPool2d(8), torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(4 * 6 * 6, classes),
    ).eval()  # fmt: skip


def tiny_onnx(path: Path, spec: PreprocessSpec, seed: int = 0) -> Path:
    """An ONNX file (mean over each channel, then a linear head) carrying `spec` as export writes it."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    classes, size = len(spec.class_names), spec.image_size
    rng = np.random.default_rng(seed)
    weights = [numpy_helper.from_array(rng.normal(size=(3, classes)).astype(np.float32), "w"),
               numpy_helper.from_array(rng.normal(size=classes).astype(np.float32), "b")]  # fmt: skip
    nodes = [
        helper.make_node("GlobalAveragePool", ["x"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["flat"]),
        helper.make_node("Gemm", ["flat", "w", "b"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", classes])], weights,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    helper.set_model_props(model, {"preprocess_spec": spec.model_dump_json()})
    onnx.save(model, str(path))
    return path
