"""Training order: train dataset + seeded generator -> per-rank batches of (images, labels, indices).

One permutation per epoch, drawn from the loader's generator exactly as DataLoader(shuffle=True) draws
it, cut to whole global batches and dealt to ranks (rank r takes every world-th sample), so a global
batch holds the same samples whatever the number of processes, and an epoch can restart mid-way.
train.imbalance balanced_sampler draws the epoch's order class by class instead (`BalancedSampler`), from
the same generator, so it resumes and deals to ranks the same way.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from tasks.training.distributed import World


def steps_in_epoch(samples: int, global_batch: int) -> int:
    """Whole global batches per epoch (a short last batch would change the step size), at least one."""
    return max(1, samples // global_batch)


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

    def order(self) -> list[int]:
        """The epoch's sample order, drawn from the generator (all of it before the first sample is yielded)."""
        return torch.randperm(self.num_samples, generator=self.generator).tolist()

    def __iter__(self) -> Iterator[int]:
        # Drawn lazily, after DataLoader has drawn its worker base seed from the same generator:
        # the order RandomSampler(generator=...) gives, so one process matches a plain shuffled loader.
        permutation = self.order()
        yield from self.rank_indices(permutation)[self.start :]
        # RandomSampler draws (and drops) one more permutation when it is exhausted; so do we, so the
        # generator, and with it every later epoch, stays on the plain loader's sequence.
        torch.randperm(self.num_samples, generator=self.generator)

    def __len__(self) -> int:
        per_rank = min(self.num_samples, self.steps_per_epoch * self.global_batch) // self.world.size
        return per_rank - self.start


class BalancedSampler(StepSampler):
    """train.imbalance balanced_sampler: every class drawn equally often. An epoch keeps the split's length;
    each class gets an equal share of it (the remainder to classes drawn at random), filled by walking shuffled
    passes over the class's images, so a rare image recurs about evenly and a frequent one is subsampled.

    The k-th repeat of image i within an epoch is yielded as i + k x num_samples (`draw_index`): the dataset
    seeds its augmentation by that number, so repeats are augmented differently, and reads image i."""

    def __init__(self, labels: Sequence[int], global_batch: int, world: World, generator: torch.Generator) -> None:
        super().__init__(len(labels), global_batch, world, generator)
        by_class: dict[int, list[int]] = {}
        for index, label in enumerate(labels):
            by_class.setdefault(int(label), []).append(index)
        self.classes = [torch.tensor(by_class[c]) for c in sorted(by_class)]

    def order(self) -> list[int]:
        gen, n = self.generator, len(self.classes)
        quota = torch.full((n,), self.num_samples // n, dtype=torch.int64)
        quota[torch.randperm(n, generator=gen)[: self.num_samples % n]] += 1
        drawn = []
        for members, wanted in zip(self.classes, quota.tolist(), strict=True):
            passes = -(-wanted // len(members))
            picks = torch.cat([members[torch.randperm(len(members), generator=gen)] for _ in range(passes)])[:wanted]
            repeat = torch.arange(wanted) // len(members)  # which pass: 0 for the first sight of each image
            drawn.append(picks + repeat * self.num_samples)
        order = torch.cat(drawn)
        return order[torch.randperm(len(order), generator=gen)].tolist()


def draw_index(index: int, num_samples: int) -> tuple[int, int]:
    """A sampler's index -> (the image, which repeat of it within the epoch)."""
    return index % num_samples, index // num_samples


class Indexed(Dataset):
    """(image, label) -> (image, label, index), so the loop counts the samples it really trained on (the image's
    index: a balanced sampler's repeat numbers are the dataset's to read, tasks/training/dataset.py)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[Any, Any, int]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[tuple[Any, Any, int]]:
        fetch = getattr(self.dataset, "__getitems__", None)  # a dataset that reads whole batches at once
        items = fetch(indices) if fetch is not None else [self.dataset[i] for i in indices]
        n = len(self)
        return [(image, label, index % n) for (image, label), index in zip(items, indices, strict=True)]


def sampler_for(imbalance: str, labels: Sequence[int], global_batch: int, world: World,
                generator: torch.Generator) -> StepSampler:  # fmt: skip
    """The train split's sampler for a resolved `train.imbalance`: class by class for balanced_sampler."""
    if imbalance == "balanced_sampler":
        return BalancedSampler(labels, global_batch, world, generator)
    return StepSampler(len(labels), global_batch, world, generator)


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
