"""The starting point of a training run, built once for everyone who needs it: the train stage, and
the tools that look at what it starts from (make sanity, make lr-find, make inspect).

`training_start` gives the seeded, augmented train split, the resolved recipe (every `auto` replaced),
and the spec; from it come the loader and its generator, the model before step 1 (architecture,
pretrained, init_from or warm-start weights, a frozen backbone), and the optimizer with its lr schedule. The train
stage adds what only it needs (devices, DDP, checkpoints); the tools take the same pieces, so what they
show is what training starts from. The train split's class counts decide train.imbalance auto (the recipe)
and feed its remedy: the loss (`class_counts`, for the step runner) or the balanced sampler (`loader`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from tasks.core.errors import StageError
from tasks.core.params import AUTO, Params, TrainParams, derive_seed
from tasks.core.paths import Paths
from tasks.images.imaging import PreprocessSpec
from tasks.images.shards import ShardSplit, load_manifest
from tasks.training.augment import Augment
from tasks.training.dataset import ShardDataset
from tasks.training.distributed import World
from tasks.training.feature_probe import SAMPLE as PROBE_SAMPLE
from tasks.training.feature_probe import feature_probe
from tasks.training.flip_probe import flip_probe
from tasks.training.loader import StepSampler, make_loader, sampler_for
from tasks.training.mirror import mirror_check, sample_indices
from tasks.training.models import build_model
from tasks.training.optim import Schedule, build_optimizer, freeze_backbone
from tasks.training.pretrained import start_weights
from tasks.training.recipe import Recipe, resolve

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Built:
    """A model as training starts it: unwrapped, on the CPU, before step 1."""

    module: torch.nn.Module
    transfer: dict[str, Any] | None  # the weights it started from (pretrained or init_from), None: random
    frozen: list[str]  # parameters a frozen backbone holds still


@dataclass(frozen=True)
class Data:
    """This rank's training loader (seeded sample order, its part of each global batch) and the val split."""

    sampler: StepSampler
    loader: torch.utils.data.DataLoader
    generator: torch.Generator
    val: ShardSplit  # memory-mapped: scored a block at a time, never held whole in memory


@dataclass(frozen=True)
class Start:
    seed: int  # the run's seed (derived from params.seed for the train stage, or for a tool)
    spec: PreprocessSpec
    dataset: ShardDataset  # the train split, augmented as training augments it (or not at all)
    recipe: Recipe  # every `auto` resolved: recipe.params
    shard_dir: Path
    pretrained_dir: Path  # paths.pretrained
    parent_dir: Path  # paths.parent: train.warm_start's parent model

    @property
    def params(self) -> TrainParams:
        return self.recipe.params

    @property
    def class_counts(self) -> list[int]:
        """Images per class of the train split: what train.imbalance's loss remedies weigh by."""
        return self.dataset.class_counts

    def loader_generator(self) -> torch.Generator:
        """A generator in the state the train stage's loader starts from (epoch 1, step 1)."""
        return torch.Generator().manual_seed(derive_seed(self.seed, "loader"))

    def loader(
        self, world: World, *, batch_size: int | None = None, num_workers: int = 0, pin_memory: bool = False
    ) -> tuple[StepSampler, torch.utils.data.DataLoader, torch.Generator]:
        """The train split's loader at the recipe's global batch (or `batch_size`), this rank's part."""
        generator = self.loader_generator()
        batch = batch_size or self.params.batch_size
        try:
            sampler = sampler_for(self.params.imbalance, self.dataset.labels, batch, world, generator)
        except ValueError as exc:
            raise StageError(f"{self.shard_dir}: {exc}; lower train.batch_size") from None
        loader = make_loader(self.dataset, sampler, num_workers=num_workers, pin_memory=pin_memory,
                             generator=generator)  # fmt: skip
        return sampler, loader, generator

    def data(self, world: World, *, pin_memory: bool = False) -> Data:
        """What the train stage's loop reads: the loader with the recipe's workers, and the val split."""
        val = ShardSplit.open(self.shard_dir, "val")
        sampler, loader, generator = self.loader(world, num_workers=self.params.num_workers, pin_memory=pin_memory)
        return Data(sampler, loader, generator, val)

    def model(self, params: TrainParams | None = None) -> Built:
        """train.arch with the weights it starts from (pretrained or init_from) and a frozen backbone if asked."""
        params = params or self.params
        module = build_model(params.arch, len(self.spec.class_names))
        transfer = start_weights(module, params, self.spec, self.pretrained_dir, self.parent_dir)
        frozen = freeze_backbone(module) if params.freeze_backbone else []
        if frozen and transfer is None:
            log.warning("freeze_backbone without pretrained or init_from: only the head of a random backbone trains")
        return Built(module, transfer, frozen)

    def optimizer(self, module: torch.nn.Module, params: TrainParams | None = None,
                  steps_per_epoch: int = 1) -> tuple[torch.optim.Optimizer, Schedule]:  # fmt: skip
        """The recipe's optimizer over `module`'s trainable parameters, and its lr schedule."""
        params = params or self.params
        optimizer = build_optimizer(module, params)
        return optimizer, Schedule(optimizer, params, steps_per_epoch)


def training_start(
    train: TrainParams, *, seed: int, shard_dir: Path, pretrained_dir: Path, world_size: int = 1,
    stream: str = "train", augment: bool = True, parent_dir: Path | None = None,
) -> Start:  # fmt: skip
    """The starting point: `seed` is params.seed; `stream` names what the seed is derived for; `parent_dir`:
    paths.parent (train.warm_start), by default its params.yaml value."""
    seed = derive_seed(seed, stream)
    spec = PreprocessSpec.model_validate(load_manifest(shard_dir)["spec"])
    dataset = ShardDataset(shard_dir, "train", seed=seed)
    mirror = None
    if train.augment.hflip == AUTO:  # measured on the images (tasks/training/mirror.py), the same on every rank
        sample = sample_indices(len(dataset), seed)
        mirror = mirror_check(dataset.data.take(sample), dataset.labels[sample], spec.class_names, seed)
    probe = None
    if train.from_weights and AUTO in (train.lr, train.backbone_lr_scale):  # how far the data is from the weights
        module = build_model(train.arch, len(spec.class_names))
        start_weights(module, train, spec, pretrained_dir)
        sample = sample_indices(len(dataset), seed, limit=PROBE_SAMPLE)
        probe = feature_probe(module, dataset.data.take(sample), dataset.labels[sample], spec, seed)
    for name, check in (("mirror check", mirror), ("feature probe", probe)):
        if check is not None:
            log.info("%s: %.2f s on %d training images", name, check.seconds, check.images)
    flips = partial(flip_probe, shard_dir=shard_dir, spec=spec, seed=seed, distributed=world_size > 1)
    recipe = resolve(train, len(dataset), world_size, mirror=mirror, probe=probe, class_counts=dataset.class_counts,
                     flip_probe=flips if augment else None)  # fmt: skip
    if augment:
        dataset.augment = Augment(recipe.params.augment)
    return Start(seed, spec, dataset, recipe, shard_dir, pretrained_dir, parent_dir or Paths().parent)


def start_of(p: Params, *, stream: str = "train", augment: bool = True) -> Start:
    """The starting point of params.yaml's train stage, for the tools."""
    return training_start(p.train, seed=p.seed, shard_dir=p.paths.shards, pretrained_dir=p.paths.pretrained,
                          stream=stream, augment=augment, parent_dir=p.paths.parent)  # fmt: skip
