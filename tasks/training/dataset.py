"""The map-style training dataset over one split of a shard directory (tasks.images.shards).

Kept apart from tasks.images.shards so that the preprocess stage, which writes shards, never imports torch
(about 1 s of start-up, and a bigger parent for its forked decoders).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tasks.images.shards import ShardSplit


class ShardDataset(torch.utils.data.Dataset):
    """Map-style dataset over one split: returns (uint8 (3, S, S) tensor, label).

    Augmentation draws from a generator seeded by (seed, epoch, index), so a sample's crop and flip
    are the same whatever the number of workers, the sampler (DistributedSampler included) or the
    batch it lands in. DataLoader fetches whole batches through `__getitems__`: one gather from
    the memory map and one batched augmentation per batch. An index past the split is a balanced sampler's
    repeat of image index % len (tasks/training/loader.py): read that image, seeded by the index as given.
    """

    def __init__(self, shard_dir: Path, split: str, *, augment: Any = None, seed: int = 0) -> None:
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

    @property
    def class_counts(self) -> list[int]:
        """Images per class of this split, in class order (train.imbalance weighs by them)."""
        return np.bincount(self.labels.astype(np.int64), minlength=len(self.class_names)).tolist()

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, int]]:
        rows = np.asarray(indices, dtype=np.int64) % len(self.labels)
        images = torch.from_numpy(self.data.take(rows))
        if self.augment is not None:
            images = self.augment.batch(images, [(self.seed, self.epoch, int(i)) for i in indices])
        return list(zip(images.unbind(0), self.labels[rows].tolist(), strict=True))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.__getitems__([index])[0]
