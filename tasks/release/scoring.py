"""A model scored on a split of the shards: metrics.json's keys plus the split's identity.

Apart from `inference` so that loading and running a model (serving) needs no pyarrow: only scoring
reads the shards.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from tasks.core.metrics import classification_metrics
from tasks.images.shards import ShardSplit, load_manifest
from tasks.release.inference import OnnxModel


def split_sha256(shard_dir: Path, split: str = "test") -> str:
    """The identity of a split: a hash of its images' content hashes (not labels) from the manifest.

    For the test split this is the manifest's frozen `test_set.sha256` (same recipe).
    """
    manifest = load_manifest(shard_dir)
    if split == "test" and "sha256" in manifest.get("test_set", {}):
        return manifest["test_set"]["sha256"]
    digests = sorted(entry["sha256"] for entry in manifest["files"] if entry["split"] == split)
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()


def score_split(model: OnnxModel, shard_dir: Path, split: str = "test", batch_size: int = 256) -> dict[str, Any]:
    """The model's classification metrics on one split (metrics.json's keys) plus the split's identity."""
    data = ShardSplit.open(shard_dir, split)
    data.require_classes(model.class_names, model.path)
    metrics = classification_metrics(model.logits(data.all_images(), batch_size), data.labels, model.class_names)
    return {**metrics, "test_set_sha256": split_sha256(shard_dir, split)}
