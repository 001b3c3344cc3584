"""The identity of a set of images: the sha256 of their content sha256s, sorted and one a line. Labels, order and
file names do not count, so the same images are the same set wherever they sit.

The test set's identity is this digest of the test split's images, from the shards' manifest: preprocess freezes
it there (`test_set.sha256`), the gate records it (regression.json's `test_set_sha256`), MLflow tags a run with it
(`data.test_sha256`) and make promote checks it (baseline/test_set.json). Every one of them asks this module.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any


def image_set_sha256(image_sha256s: Iterable[str]) -> str:
    """The identity of the images whose content sha256s are given, in any order."""
    return hashlib.sha256("\n".join(sorted(image_sha256s)).encode()).hexdigest()


def split_sha256(manifest: Mapping[str, Any], split: str = "test") -> str:
    """The identity of one split of a shards manifest (its `files`, each with `split` and `sha256`)."""
    return image_set_sha256(entry["sha256"] for entry in manifest["files"] if entry["split"] == split)
