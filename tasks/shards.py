"""Arrow IPC shards of uint8 images: the writer, the checksummed manifest, and a map-style dataset.

Layout of a shard directory:
    manifest.json          schema, class names, spec, per-shard sha256 and counts, per-file hashes
    quarantine.json        files refused or ignored, with reasons
    <split>-<k:05d>.arrow  columns image: fixed_size_list<uint8>[3*S*S] (C, H, W), label: int16
Nothing in it depends on time, host or absolute paths, so the same input gives the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from tasks.io import read_json, sha256_file

MANIFEST = "manifest.json"
QUARANTINE = "quarantine.json"
SPLITS = ("train", "val", "test")
FORMAT_VERSION = 1


class ShardError(RuntimeError):
    """A shard directory that is missing, incomplete or altered."""


def shard_schema(image_size: int) -> pa.Schema:
    return pa.schema(
        [
            pa.field("image", pa.list_(pa.uint8(), 3 * image_size * image_size)),
            pa.field("label", pa.int16()),
        ],
        metadata={"image_shape": f"3,{image_size},{image_size}", "layout": "CHW"},
    )


def write_shard(path: Path, images: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
    """Write (N, 3, S, S) uint8 images + labels as one Arrow IPC file; returns its manifest entry."""
    count, _, size, _ = images.shape
    flat = pa.array(np.ascontiguousarray(images).reshape(-1), type=pa.uint8())
    column = pa.FixedSizeListArray.from_arrays(flat, 3 * size * size)
    table = pa.Table.from_arrays(
        [column, pa.array(labels.astype(np.int16), type=pa.int16())], schema=shard_schema(size)
    )
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return {"file": path.name, "count": int(count), "sha256": sha256_file(path)}


def load_manifest(shard_dir: Path) -> dict[str, Any]:
    path = Path(shard_dir) / MANIFEST
    if not path.is_file():
        raise ShardError(f"{path}: no shard manifest; run the preprocess stage first")
    manifest = read_json(path)
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ShardError(f"{path}: format_version {manifest.get('format_version')!r}, expected {FORMAT_VERSION}")
    return manifest


@dataclass
class ShardSplit:
    """One split of a shard directory, memory-mapped: `images` is a list of (n, 3, S, S) views."""

    images: list[np.ndarray]
    labels: np.ndarray
    class_names: tuple[str, ...]
    offsets: np.ndarray

    @classmethod
    def open(cls, shard_dir: Path, split: str, *, verify: bool = True) -> ShardSplit:
        shard_dir = Path(shard_dir)
        manifest = load_manifest(shard_dir)
        if split not in manifest["splits"]:
            raise ShardError(f"{shard_dir / MANIFEST}: no split {split!r}")
        size = manifest["image_size"]
        images, labels = [], []
        for entry in manifest["splits"][split]["shards"]:
            path = shard_dir / entry["file"]
            if not path.is_file():
                raise ShardError(f"{path}: shard listed in the manifest is missing")
            if verify and sha256_file(path) != entry["sha256"]:
                raise ShardError(f"{path}: checksum does not match the manifest; the shard was altered")
            table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
            column = table.column("image").combine_chunks()
            images.append(column.values.to_numpy(zero_copy_only=True).reshape(-1, 3, size, size))
            labels.append(table.column("label").to_numpy())
        counts = [len(block) for block in images]
        return cls(
            images=images,
            labels=np.concatenate(labels).astype(np.int64) if labels else np.zeros(0, np.int64),
            class_names=tuple(manifest["class_names"]),
            offsets=np.cumsum([0, *counts]),
        )

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def image(self, index: int) -> np.ndarray:
        block = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return self.images[block][index - self.offsets[block]]

    def all_images(self) -> np.ndarray:
        return np.concatenate(self.images) if self.images else np.zeros((0, 3, 1, 1), np.uint8)


class ShardDataset(torch.utils.data.Dataset):
    """Map-style dataset over one split: returns (uint8 (3, S, S) tensor, label).

    Augmentation draws from a generator seeded by (seed, epoch, index), so a sample's crop and flip
    are the same whatever the number of workers or the order in which samples are read.
    """

    def __init__(
        self,
        shard_dir: Path,
        split: str,
        *,
        augment: Any = None,
        seed: int = 0,
    ) -> None:
        self.shard_dir, self.split, self.augment, self.seed = Path(shard_dir), split, augment, seed
        self.epoch = 0
        self._data: ShardSplit | None = ShardSplit.open(self.shard_dir, split)
        self.labels = self._data.labels
        self.class_names = self._data.class_names

    def __getstate__(self) -> dict[str, Any]:  # memory maps are reopened in each worker
        state = dict(self.__dict__)
        state["_data"] = None
        return state

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def data(self) -> ShardSplit:
        if self._data is None:
            self._data = ShardSplit.open(self.shard_dir, self.split, verify=False)
        return self._data

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = torch.from_numpy(self.data.image(index).copy())
        if self.augment is not None:
            image = self.augment(image, (self.seed, self.epoch, index))
        return image, int(self.labels[index])


def class_counts(labels: Sequence[int], num_classes: int) -> list[int]:
    return np.bincount(np.asarray(labels, dtype=np.int64), minlength=num_classes).tolist()
