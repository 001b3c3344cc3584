"""Nested mappings (params, metrics, environment records) as dotted leaves: the one flattener."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 0.1, "sizes": [1, 2]}} -> {"train.lr": 0.1, "train.sizes": [1, 2]}, in the mapping's
    order. Lists and every other value are leaves; a value that is not a mapping is {prefix: value}."""
    if not isinstance(tree, Mapping):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out |= flatten(value, f"{prefix}.{key}" if prefix else str(key))
    return out
