"""manifest.json's content: what preprocess wrote and by which rules (tasks/preprocess.py writes it)."""

from __future__ import annotations

from typing import Any

from tasks.core.params import PreprocessParams
from tasks.images.image_set import image_set_sha256
from tasks.images.imaging import PreprocessSpec
from tasks.images.layout import Layout
from tasks.images.reuse import decoder_versions
from tasks.images.shard_layout import RULE
from tasks.images.shards import FORMAT_VERSION, SPLITS, class_counts, schema_description
from tasks.images.splits import Plan
from tasks.images.validation import TEST_SOURCE, VAL_SOURCE


def manifest_of(
    params: PreprocessParams, seed: int, spec: PreprocessSpec, layout: Layout, counts: dict[str, int],
    todo: Plan, split_counts: dict[str, int], labels: dict[str, list[int]], shards: dict[str, Any],
    files: list[dict[str, Any]], resize: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """manifest.json: format, spec (and why its resize), the folders' layout, split rule, counts, shards, the
    frozen test set and every accepted file."""
    class_names = spec.class_names
    test_hashes = sorted(f["sha256"] for f in files if f["split"] == "test")
    return {
        "format_version": FORMAT_VERSION,
        "image_size": params.image_size,
        "schema": schema_description(params.image_size),
        "class_names": list(class_names),
        "spec": spec.model_dump(mode="json"),
        "resize": resize,
        "layout": layout.to_json(),
        "decoder": decoder_versions(),
        "shard_rule": RULE,
        "split_rule": {
            "by": "sha256 of the file's bytes and the seed",
            "seed": seed,
            "val_fraction": 0.0 if "val" in layout.fixed else params.val_fraction,
            "test_fraction": 0.0 if "test" in layout.fixed else params.test_fraction,
            "val": _rule(layout, VAL_SOURCE),
            "test": _rule(layout, TEST_SOURCE),
        },
        "counts": counts,
        "duplicate_groups": len(todo.duplicates),
        "splits": {
            split: {
                "count": split_counts[split],
                "class_counts": class_counts(labels[split], len(class_names)),
                "shards": shards[split],
            }
            for split in SPLITS
        },
        "test_set": {
            "count": len(test_hashes),
            "sha256": image_set_sha256(test_hashes),  # the test set's one identity (tasks/images/image_set.py)
            "files": test_hashes,
        },
        "files": files,
    }


def _rule(layout: Layout, role: str) -> str:
    folder = layout.folder(role)
    if folder is None:
        return "hash range"
    return "data.test_source" if layout.kind == "class folders" else f"folder {folder.name}"
