"""A model scored on a split of the shards: metrics.json's keys plus the split's identity (tasks/images/image_set.py),
and per image (in the split's order, named by its content sha256) the true and the predicted class, for paired
comparisons.

Apart from `inference` so that loading and running a model (serving) needs no pyarrow: only scoring
reads the shards.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tasks.core.blocks import block_rows
from tasks.core.metrics import classification_metrics
from tasks.images.image_set import image_set_sha256, split_sha256
from tasks.images.shards import MANIFEST, ShardError, ShardSplit, load_manifest
from tasks.release.inference import OnnxModel


@dataclass(frozen=True)
class SplitScores:
    """A model on one split: its metrics, and per image in the shards' row order the image's content sha256
    (from the manifest), its true class index and the model's predicted class index (argmax of the logits)."""

    metrics: dict[str, Any]
    images: tuple[str, ...]
    labels: tuple[int, ...]
    predicted: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"metrics": self.metrics, "images": list(self.images), "labels": list(self.labels),
                "predicted": list(self.predicted)}  # fmt: skip

    @classmethod
    def from_json(cls, data: Any) -> SplitScores | None:
        """The scores `to_json` wrote, or None when `data` is not such a record (a cache from older code)."""
        if not isinstance(data, Mapping) or not isinstance(data.get("metrics"), dict):
            return None
        images, labels, predicted = (data.get(key) for key in ("images", "labels", "predicted"))
        if not (isinstance(images, list) and isinstance(labels, list) and isinstance(predicted, list)):
            return None
        if not len(images) == len(labels) == len(predicted):
            return None
        if not all(isinstance(x, str) for x in images) or not all(type(x) is int for x in labels + predicted):
            return None
        return cls(data["metrics"], tuple(images), tuple(labels), tuple(predicted))


def split_images(shard_dir: Path, split: str = "test", manifest: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """The content sha256 of each image of a split, in the shards' row order (the manifest's `index`);
    `manifest`: the shard directory's, when the caller has already read it."""
    files = (manifest if manifest is not None else load_manifest(shard_dir))["files"]
    entries = sorted((e for e in files if e["split"] == split), key=lambda e: e["index"])
    if [e["index"] for e in entries] != list(range(len(entries))):
        raise ShardError(f"{Path(shard_dir) / MANIFEST}: the {split} files' indices are not 0..n-1; rerun preprocess")
    return tuple(e["sha256"] for e in entries)


def score_images(model: OnnxModel, shard_dir: Path, split: str = "test", batch_size: int = 256) -> SplitScores:
    """The model's metrics on one split plus its prediction for every image of it, read a block at a time."""
    data = ShardSplit.open(shard_dir, split)
    data.require_classes(model.class_names, model.path)
    logits = model.logits(data.blocks(block_rows(model.spec.image_size, batch_size)), batch_size)
    metrics = classification_metrics(logits, data.labels, model.class_names)
    manifest = load_manifest(shard_dir)
    images = split_images(shard_dir, split, manifest)
    if len(images) != len(data.labels):
        raise ShardError(f"{Path(shard_dir) / MANIFEST}: lists {len(images)} {split} files, the shards hold "
                         f"{len(data.labels)} images; rerun preprocess")  # fmt: skip
    return SplitScores(
        metrics={**metrics, "test_set_sha256": split_sha256(manifest, split)},
        images=images,
        labels=tuple(int(x) for x in data.labels),
        predicted=tuple(int(x) for x in logits.argmax(axis=1)),
    )


def score_split(model: OnnxModel, shard_dir: Path, split: str = "test", batch_size: int = 256) -> dict[str, Any]:
    """The model's classification metrics on one split (metrics.json's keys) plus the split's identity."""
    return score_images(model, shard_dir, split, batch_size).metrics


def score_promoted_set(model: OnnxModel, shard_dir: Path, promoted: Collection[str], batch_size: int = 256
                       ) -> dict[str, Any]:  # fmt: skip
    """The model's metrics on the test images of today's split that were in the promoted test set (their content
    sha256, baseline/test_set.json), with their identity by the split's recipe: when every promoted image is still
    there, the promoted test set itself, whatever images joined the split since (the nightly's fixed test set)."""
    data = ShardSplit.open(shard_dir, "test")
    data.require_classes(model.class_names, model.path)
    images = split_images(shard_dir, "test")
    rows = np.array([i for i, digest in enumerate(images) if digest in promoted], dtype=np.int64)
    logits = model.logits(data.blocks(block_rows(model.spec.image_size, batch_size), rows), batch_size)
    metrics = classification_metrics(logits, np.asarray(data.labels)[rows], model.class_names)
    return {**metrics, "test_set_sha256": image_set_sha256(images[i] for i in rows)}
