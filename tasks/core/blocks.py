"""A pass over a whole split, one block at a time: how many images a block holds, and blocks re-cut into a
predictor's batches. The batches are the rows a single (N, 3, S, S) array would have given, cut at the same
places, so logits computed block by block are the same bits as from the whole split in memory; only the
logits (N x classes) grow with the dataset."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

BLOCK_BYTES = 64 << 20  # uint8 pixels per block, rounded down to whole batches (at 224 px: one batch of 256, 38.5 MB)


def block_rows(image_size: int, batch_size: int, budget: int | None = None) -> int:
    """Rows per block for uint8 (3, S, S) images: whole batches of `batch_size` within `budget` bytes (BLOCK_BYTES),
    at least one batch, so that re-cutting the blocks into batches copies nothing."""
    budget = BLOCK_BYTES if budget is None else budget
    return batch_size * max(1, budget // (batch_size * 3 * image_size * image_size))


def batches(images: np.ndarray | Iterable[np.ndarray], batch_size: int) -> Iterator[np.ndarray]:
    """An (N, ...) array, or its rows in blocks of any sizes (ShardSplit.blocks), -> consecutive batches of
    `batch_size` rows, the last one fewer: the same rows in the same batches, whatever the blocks' boundaries."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if isinstance(images, np.ndarray):
        yield from (images[start : start + batch_size] for start in range(0, len(images), batch_size))
        return
    held: list[np.ndarray] = []  # the start of a batch that crosses a block boundary (copies: < one batch)
    count = 0
    for block in images:
        start = 0
        if held:
            start = min(batch_size - count, len(block))
            held.append(block[:start].copy())
            count += start
            if count < batch_size:
                continue
            yield np.concatenate(held)
            held, count = [], 0
        while len(block) - start >= batch_size:
            yield block[start : start + batch_size]
            start += batch_size
        if start < len(block):
            held, count = [block[start:].copy()], len(block) - start
    if held:
        yield np.concatenate(held)
