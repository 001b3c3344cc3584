"""What the train stage starts from, for the tools that look at it (make inspect, make lr-find): its
seeded, augmented training split, its resolved recipe, its loader's generator and its model before
step 1, built as tasks/train.py builds them (without DDP, devices or checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tasks.core.params import Params, TrainParams, derive_seed
from tasks.images.imaging import PreprocessSpec
from tasks.images.shards import load_manifest
from tasks.training.augment import Augment
from tasks.training.dataset import ShardDataset
from tasks.training.models import build_model
from tasks.training.optim import freeze_backbone
from tasks.training.pretrained import start_weights
from tasks.training.recipe import resolve


@dataclass(frozen=True)
class Start:
    seed: int  # the train stage's seed (derived from params.seed)
    spec: PreprocessSpec
    dataset: ShardDataset  # the train split, augmented as training augments it
    recipe: TrainParams  # every `auto` resolved
    pretrained_dir: Path  # paths.pretrained

    def loader_generator(self) -> torch.Generator:
        """A generator in the state the train stage's loader starts from (epoch 1, step 1)."""
        return torch.Generator().manual_seed(derive_seed(self.seed, "loader"))

    def fresh_model(self) -> torch.nn.Module:
        """The model as training starts it: train.arch, pretrained or init_from weights, a frozen backbone if asked."""
        model = build_model(self.recipe.arch, len(self.spec.class_names))
        start_weights(model, self.recipe, self.spec, self.pretrained_dir)
        if self.recipe.freeze_backbone:
            freeze_backbone(model)
        return model


def training_start(p: Params) -> Start:
    seed = derive_seed(p.seed, "train")
    spec = PreprocessSpec.model_validate(load_manifest(p.paths.shards)["spec"])
    dataset = ShardDataset(p.paths.shards, "train", augment=Augment(p.train.augment), seed=seed)
    return Start(seed, spec, dataset, resolve(p.train, len(dataset)).params, p.paths.pretrained)
