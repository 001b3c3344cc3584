"""Writing the shard layout (tasks/images/shard_layout.py) as images arrive in its order, reusing what exists.

`ShardBuilder.add` takes each accepted image once, in (split, generation, sha256) order, either as a row of the
reuse pool (tasks/images/reuse.py, memory-mapped) or as freshly decoded pixels. A shard made only of pool rows that
an existing shard holds in the same order with the same labels is that file, hard-linked; any other is written,
streamed in record batches. Each closed shard is appended to the temporary folder's PROGRESS file, so a run killed
later leaves it for the rerun to reuse. Memory: one record batch, whatever the dataset's size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tasks.images.reuse import PROGRESS, Pool, link_or_copy, progress_line
from tasks.images.shard_layout import Cutter, shard_name
from tasks.images.shards import SPLITS, ShardFile


class ShardBuilder:
    def __init__(self, out_dir: Path, pool: Pool, *, image_size: int, shard_size: int) -> None:
        self.out_dir, self.pool, self.image_size = Path(out_dir), pool, image_size
        self.cutter = Cutter(shard_size)
        self.shards: dict[str, list[dict[str, Any]]] = {split: [] for split in SPLITS}
        self.stats = {"linked": 0, "copied": 0, "decoded": 0, "linked_shards": 0, "written_shards": 0}
        self._progress = open(self.out_dir / PROGRESS, "a")  # noqa: SIM115 - closed by finish()
        self._open: tuple[str, int] | None = None
        self._images: list[str] = []
        self._labels: list[int] = []
        self._shapes: list[tuple[int, int]] = []
        self._pending = 0  # leading pool rows of the open shard, not read yet: it may still be a whole reuse
        self._file: ShardFile | None = None

    def add(self, split: str, generation: int, digest: str, label: int, shape: tuple[int, int],
            pixels: np.ndarray | None) -> None:  # fmt: skip
        """`pixels` None: the pool's row for `digest`, read only if the shard is written rather than linked."""
        if self.cutter.starts_new(split, generation):
            self._close()
            self._open = (split, generation)
        self._images.append(digest)
        self._labels.append(label)
        self._shapes.append(shape)
        if pixels is None and self._file is None:
            self._pending += 1
        else:
            self._writer().add(self.pool.row(digest) if pixels is None else pixels, label)
        self.stats["copied" if pixels is None else "decoded"] += 1
        if self.cutter.add(digest):
            self._close()

    def _writer(self) -> ShardFile:
        if self._file is None:
            assert self._open is not None
            self._file = ShardFile(self.out_dir / shard_name(*self._open, self._images[0]), image_size=self.image_size)
            for digest, label in zip(self._images[: self._pending], self._labels, strict=False):
                self._file.add(self.pool.row(digest), label)
            self._pending = 0
        return self._file

    def _close(self) -> None:
        if not self._images or self._open is None:
            return
        split, generation = self._open
        name = shard_name(split, generation, self._images[0])
        existing = self.pool.shard_like(self._images, self._labels) if self._file is None else None
        if existing is not None:
            link_or_copy(existing.path, self.out_dir / name)
            entry = {"file": name, "count": len(self._images), "sha256": existing.sha256}
            self.stats["linked"] += len(self._images)
            self.stats["copied"] -= len(self._images)
            self.stats["linked_shards"] += 1
        else:
            entry = self._writer().close()
            self.stats["written_shards"] += 1
        self.shards[split].append({**entry, "generation": generation})
        self._progress.write(progress_line(entry, self.pool.key, self._images, self._labels, self._shapes))
        self._progress.flush()
        self._images, self._labels, self._shapes, self._pending, self._file = [], [], [], 0, None

    def finish(self) -> dict[str, list[dict[str, Any]]]:
        """Close the last shard; the PROGRESS file goes (the finished folder holds shards and their manifest only)."""
        self._close()
        self._progress.close()
        (self.out_dir / PROGRESS).unlink()
        return self.shards

    def abandon(self) -> None:
        if self._file is not None:
            self._file.abandon()
        self._progress.close()
