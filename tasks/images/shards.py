"""Arrow IPC shards of uint8 images: the streaming writer, the checksummed manifest, the memory-mapped reader.

Layout of a shard directory:
    manifest.json          schema, class names, spec, per-shard sha256 and counts, per-file hashes
    quarantine.json        files refused or ignored, with reasons; duplicate groups
    <split>-g<generation>-<first sha256>.arrow  columns image: fixed_size_list<uint8>[3*S*S] (C, H, W),
                           label: int16 (which image goes where: tasks/images/shard_layout.py)
Nothing in it depends on time, host or absolute paths, so the same input gives the same bytes.
Reading memory-maps the files: a sample is a view into the page cache, never a decode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tasks.core.errors import StageError
from tasks.core.io import read_json, sha256_file

if TYPE_CHECKING:  # pyarrow loads where shards are read or written: the manifest alone needs none
    import pyarrow as pa

MANIFEST = "manifest.json"
QUARANTINE = "quarantine.json"
SPLITS = ("train", "val", "test")
FORMAT_VERSION = 3  # 3: shards by generation and content-defined cuts, per-file shapes, the decoder's versions
BATCH_BYTES = 8 << 20  # pixel data per record batch: bounds writer memory, and shards are written as
# results arrive rather than in one burst at the end (reads gather per row, so batch count costs nothing)


class ShardError(StageError):
    """A shard directory that is missing, incomplete or altered, or not the one a model was made for:
    a StageError, so a stage reports it in one line (exit 2), not as a traceback."""


def shard_schema(image_size: int) -> pa.Schema:
    import pyarrow as pa

    return pa.schema(
        [
            pa.field("image", pa.list_(pa.uint8(), 3 * image_size * image_size)),
            pa.field("label", pa.int16()),
        ],
        metadata={"image_shape": f"3,{image_size},{image_size}", "layout": "CHW"},
    )


def schema_description(image_size: int) -> dict[str, Any]:
    """The schema as recorded in the manifest (and checked against every shard on open)."""
    schema = shard_schema(image_size)
    return {
        "columns": {f.name: str(f.type) for f in schema},
        "image_shape": [3, image_size, image_size],
        "dtype": "uint8",
        "layout": "CHW",
    }


def _record_batch(images: np.ndarray, labels: np.ndarray, schema: pa.Schema) -> pa.RecordBatch:
    import pyarrow as pa

    size = images.shape[-1]
    flat = pa.array(np.ascontiguousarray(images, dtype=np.uint8).reshape(-1), type=pa.uint8())
    column = pa.FixedSizeListArray.from_arrays(flat, 3 * size * size)
    return pa.RecordBatch.from_arrays([column, pa.array(labels.astype(np.int16), type=pa.int16())], schema=schema)


class ShardFile:
    """Writes (3, S, S) uint8 images, in order, to one Arrow IPC file at `path`.

    Images are written in record batches of at most BATCH_BYTES, so memory stays bounded whatever the shard's
    length; the same sequence of images always gives the same bytes. Nothing is at `path` until `close`.
    """

    def __init__(self, path: Path, *, image_size: int) -> None:
        import pyarrow as pa

        self.path = Path(path)
        self.schema = shard_schema(image_size)
        self.batch_rows = max(1, BATCH_BYTES // (3 * image_size * image_size))
        self._shape = (3, image_size, image_size)
        self._buffer = np.empty((self.batch_rows, *self._shape), np.uint8)  # pages touched only as rows fill
        self._labels: list[int] = []
        self._partial = self.path.with_name(f".{self.path.name}.partial")
        self._sink = pa.OSFile(str(self._partial), "wb")
        self._writer = pa.ipc.new_file(self._sink, self.schema)
        self.rows = 0

    def add(self, image: np.ndarray, label: int) -> None:
        if image.shape != self._shape or image.dtype != np.uint8:
            raise ValueError(f"{self.path.name}: expected a uint8 {self._shape} image, got {image.dtype} {image.shape}")
        self._buffer[len(self._labels)] = image
        self._labels.append(label)
        if len(self._labels) == self.batch_rows:
            self._flush()

    def _flush(self) -> None:
        if not self._labels:
            return
        count = len(self._labels)
        self._writer.write_batch(_record_batch(self._buffer[:count], np.asarray(self._labels), self.schema))
        self.rows += count
        self._labels = []

    def close(self) -> dict[str, Any]:
        """Write what is buffered, close the file and move it to `path`; returns its manifest entry."""
        self._flush()
        self._writer.close()
        self._sink.close()
        self._partial.rename(self.path)
        return {"file": self.path.name, "count": self.rows, "sha256": sha256_file(self.path)}

    def abandon(self) -> None:
        with contextlib.suppress(Exception):
            self._writer.close()
        with contextlib.suppress(Exception):
            self._sink.close()
        self._partial.unlink(missing_ok=True)


def load_manifest(shard_dir: Path) -> dict[str, Any]:
    path = Path(shard_dir) / MANIFEST
    if not path.is_file():
        raise ShardError(f"{path}: no shard manifest; run the preprocess stage first")
    manifest = read_json(path)
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ShardError(
            f"{path}: format_version {manifest.get('format_version')!r}, expected {FORMAT_VERSION}; "
            "rerun the preprocess stage"
        )
    return manifest


def _read_shard(path: Path, entry: dict[str, Any], size: int, verify: bool) -> tuple[list[np.ndarray], np.ndarray]:
    """Memory-map one shard: a (n, 3, S, S) view per record batch, and its labels."""
    import pyarrow as pa

    if not path.is_file():
        raise ShardError(f"{path}: shard listed in the manifest is missing")
    if verify and sha256_file(path) != entry["sha256"]:
        raise ShardError(f"{path}: checksum does not match the manifest; the shard was altered or half-written")
    try:
        reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
    except pa.ArrowInvalid as exc:
        raise ShardError(f"{path}: not a readable Arrow IPC file ({exc})") from None
    if not reader.schema.equals(shard_schema(size), check_metadata=True):
        raise ShardError(f"{path}: schema {reader.schema} differs from the manifest's image size {size}")
    blocks, labels = [], []
    for i in range(reader.num_record_batches):
        batch = reader.get_batch(i)
        pixels = batch.column(0).flatten().to_numpy(zero_copy_only=True)
        blocks.append(pixels.reshape(-1, 3, size, size))
        labels.append(batch.column(1).to_numpy())
    count = sum(len(block) for block in blocks)
    if count != entry["count"]:
        raise ShardError(f"{path}: {count} rows, the manifest says {entry['count']}")
    return blocks, np.concatenate(labels) if labels else np.zeros(0, np.int16)


@dataclass
class ShardSplit:
    """One split of a shard directory, memory-mapped: `images` is a list of read-only (n, 3, S, S) views."""

    images: list[np.ndarray]
    labels: np.ndarray
    class_names: tuple[str, ...]
    offsets: np.ndarray
    shard_dir: Path | None = None

    def require_classes(self, class_names: Sequence[str], model: object) -> None:
        """Refuse a model (named by `model`) whose class names, in order, are not this split's."""
        if tuple(class_names) != self.class_names:
            raise ShardError(
                f"{model}: classes {list(class_names)} differ from {self.shard_dir}'s {list(self.class_names)}"
            )

    @classmethod
    def open(cls, shard_dir: Path, split: str, *, verify: bool = True) -> ShardSplit:
        """Open a split; with `verify`, every shard's sha256 is checked against the manifest first."""
        shard_dir = Path(shard_dir)
        manifest = load_manifest(shard_dir)
        if split not in manifest["splits"]:
            raise ShardError(f"{shard_dir / MANIFEST}: no split {split!r} (has {sorted(manifest['splits'])})")
        size = manifest["image_size"]
        images, labels = [], []
        for entry in manifest["splits"][split]["shards"]:
            blocks, shard_labels = _read_shard(shard_dir / entry["file"], entry, size, verify)
            images.extend(blocks)
            labels.append(shard_labels)
        return cls(
            images=images,
            labels=np.concatenate(labels).astype(np.int64) if labels else np.zeros(0, np.int64),
            class_names=tuple(manifest["class_names"]),
            offsets=np.cumsum([0, *(len(block) for block in images)]),
            shard_dir=shard_dir,
        )

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def image(self, index: int) -> np.ndarray:
        """A read-only view of one image (3, S, S); no copy."""
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for a split of {len(self)} images")
        block = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return self.images[block][index - self.offsets[block]]

    def take(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Images at `indices` gathered into one new writable (n, 3, S, S) array (the only copy)."""
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"indices out of range for a split of {len(self)} images")
        shape = self.images[0].shape[1:] if self.images else (3, 1, 1)
        out = np.empty((len(indices), *shape), dtype=np.uint8)
        blocks = np.searchsorted(self.offsets, indices, side="right") - 1
        rows = indices - self.offsets[blocks]
        for k, (block, row) in enumerate(zip(blocks.tolist(), rows.tolist(), strict=True)):
            out[k] = self.images[block][row]  # one row copy: as fast as fancy indexing, for any block count
        return out

    def all_images(self) -> np.ndarray:
        return np.concatenate(self.images) if self.images else np.zeros((0, 3, 1, 1), np.uint8)

    def span(self, start: int, stop: int) -> np.ndarray:
        """Images start..stop-1 copied into one new writable (n, 3, S, S) array, a slice of each map they span."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"rows {start}..{stop} out of range for a split of {len(self)} images")
        shape = self.images[0].shape[1:] if self.images else (3, 1, 1)
        out = np.empty((stop - start, *shape), dtype=np.uint8)
        block = int(np.searchsorted(self.offsets, start, side="right")) - 1
        row = start
        while row < stop:
            first, end = int(self.offsets[block]), int(self.offsets[block + 1])
            count = min(stop, end) - row
            out[row - start : row - start + count] = self.images[block][row - first : row - first + count]
            row, block = row + count, block + 1
        return out

    def blocks(self, rows: int, indices: Sequence[int] | np.ndarray | None = None) -> map[np.ndarray]:
        """The split in row order (or the images at `indices`, in their order) as an iterator of new writable
        (n, 3, S, S) arrays of `rows` images (the last one fewer), each copied when the loop asks for it: a pass
        over the whole split holds one block, where all_images() holds the split (N x 3 x S x S bytes)."""
        if rows < 1:
            raise ValueError(f"rows per block must be at least 1, got {rows}")
        if indices is None:
            return map(lambda start: self.span(start, min(start + rows, len(self))), range(0, len(self), rows))
        picked = np.asarray(indices, dtype=np.int64)
        if len(picked) and (picked.min() < 0 or picked.max() >= len(self)):
            raise IndexError(f"indices out of range for a split of {len(self)} images")
        return map(lambda start: self.take(picked[start : start + rows]), range(0, len(picked), rows))


def class_counts(labels: Sequence[int], num_classes: int) -> list[int]:
    return np.bincount(np.asarray(labels, dtype=np.int64), minlength=num_classes).tolist()
