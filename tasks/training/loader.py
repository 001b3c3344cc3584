"""Training order: train dataset + seeded generator -> per-rank batches of (images, labels, indices).

One permutation per epoch, drawn from the loader's generator exactly as DataLoader(shuffle=True) draws
it, cut to whole global batches and dealt to ranks (rank r takes every world-th sample), so a global
batch holds the same samples whatever the number of processes, and an epoch can restart mid-way.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from tasks.training.distributed import World
from tasks.training.recipe import steps_in_epoch


class StepSampler(Sampler[int]):
    """This rank's indices of the epoch; `start` skips the ones a resumed run already trained on."""

    def __init__(self, num_samples: int, global_batch: int, world: World, generator: torch.Generator) -> None:
        if world.is_distributed and num_samples < global_batch:
            raise ValueError(f"{num_samples} training samples are fewer than one global batch ({global_batch})")
        self.num_samples, self.global_batch, self.world, self.generator = num_samples, global_batch, world, generator
        self.start = 0

    @property
    def steps_per_epoch(self) -> int:
        return steps_in_epoch(self.num_samples, self.global_batch)

    def rank_indices(self, permutation: Sequence[int]) -> list[int]:
        """Whole global batches only (a short last batch would change the step size), dealt to ranks."""
        usable = permutation[: self.steps_per_epoch * self.global_batch]
        return list(usable[self.world.rank :: self.world.size])

    def __iter__(self) -> Iterator[int]:
        # Drawn lazily, after DataLoader has drawn its worker base seed from the same generator:
        # the order RandomSampler(generator=...) gives, so one process matches a plain shuffled loader.
        permutation = torch.randperm(self.num_samples, generator=self.generator).tolist()
        yield from self.rank_indices(permutation)[self.start :]
        # RandomSampler draws (and drops) one more permutation when it is exhausted; so do we, so the
        # generator, and with it every later epoch, stays on the plain loader's sequence.
        torch.randperm(self.num_samples, generator=self.generator)

    def __len__(self) -> int:
        per_rank = min(self.num_samples, self.steps_per_epoch * self.global_batch) // self.world.size
        return per_rank - self.start


class Indexed(Dataset):
    """(image, label) -> (image, label, index), so the loop counts the samples it really trained on."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[Any, Any, int]:
        image, label = self.dataset[index]
        return image, label, index

    def __getitems__(self, indices: list[int]) -> list[tuple[Any, Any, int]]:
        fetch = getattr(self.dataset, "__getitems__", None)  # a dataset that reads whole batches at once
        items = fetch(indices) if fetch is not None else [self.dataset[i] for i in indices]
        return [(image, label, index) for (image, label), index in zip(items, indices, strict=True)]


def make_loader(
    dataset: Dataset, sampler: StepSampler, *, num_workers: int, pin_memory: bool, generator: torch.Generator
) -> DataLoader:
    """Batches of global_batch / world samples: the optimizer step splits them into micro-batches."""
    return DataLoader(
        Indexed(dataset),
        batch_size=sampler.global_batch // sampler.world.size,
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        generator=generator,
        # Not persistent: a persistent worker keeps its copy of the dataset, so set_epoch would not
        # reach it and the per-sample augmentation seed (seed, epoch, index) would go stale.
        persistent_workers=False,
    )
