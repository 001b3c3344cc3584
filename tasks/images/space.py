"""Before anything is decoded: the space the new shards need against what the filesystem has free.

Shards that an earlier run left exactly as the new layout wants them are hard links (no space); every other shard
is written in full, beside the previous directory (which stays until the new one is complete), so the estimate
is the rows of those shards times a row's bytes. DVC then copies each new shard into its cache (unless
cache.type links): a warning when the space would not also hold that copy.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tasks.core.errors import StageError
from tasks.images.reuse import Pool
from tasks.images.shard_layout import Cutter

log = logging.getLogger(__name__)
OVERHEAD = 1 << 20  # manifest, quarantine report, Arrow footers


def human(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


def bytes_to_write(order: Sequence[tuple[Any, str, str, int]], pool: Pool, image_size: int, shard_size: int) -> int:
    """The bytes of the shards this layout writes (as if every image to decode is accepted: an upper bound)."""
    row = 3 * image_size * image_size
    cutter, total = Cutter(shard_size), OVERHEAD
    images: list[str] = []
    labels: list[int] = []

    def close() -> None:
        nonlocal total
        if images and pool.shard_like(images, labels) is None:
            total += len(images) * row
        images.clear()
        labels.clear()

    for item, digest, split, generation in order:
        if cutter.starts_new(split, generation):
            close()
        images.append(digest)
        labels.append(item.label)
        if cutter.add(digest):
            close()
    close()
    return total


def free_space(path: Path) -> int:
    """Free bytes on the filesystem `path` would be on (its nearest existing folder)."""
    folder = Path(path).absolute()
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def check_space(out_dir: Path, order: Sequence[tuple[Any, str, str, int]], pool: Pool, image_size: int,
                shard_size: int) -> None:  # fmt: skip
    needed, free = bytes_to_write(order, pool, image_size, shard_size), free_space(out_dir)
    if needed > free:
        raise StageError(f"{out_dir}: the shards need {human(needed)} and {human(free)} is free there; free space "
                         "or set paths.shards on a larger disk (nothing was decoded, the previous shards are as they "
                         "were)")  # fmt: skip
    if 2 * needed > free:
        log.warning("%s: %s free for %s of new shards: DVC's cache, on the same disk with cache.type copy, needs as "
                    "much again when the stage ends", out_dir, human(free), human(needed))  # fmt: skip
