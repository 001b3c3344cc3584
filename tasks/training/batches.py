"""See the data as the model does: the first training batch and a spread of validation images, as grids
(reports/train_batch.png, reports/val_batch.png and TensorBoard's Images tab).

The training grid is the run's real first batch: the same sampler, seeded generator and per-sample
augmentation as the loop's loader, drawn from a copy of the generator so the run itself is untouched
(also when it resumes mid-way: the grid is always the first batch of epoch 1). The images are the
uint8 pixels that the step normalises with the spec's mean and std, which is the model's input
denormalised. The validation grid shows the same split the loop validates on, with no augmentation,
so the two grids side by side show what augmentation does.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torchvision.utils import make_grid

from tasks.core.params import AugmentParams
from tasks.core.plots import plot_image_grid
from tasks.images.shards import ShardSplit
from tasks.training.dataset import ShardDataset
from tasks.training.distributed import World
from tasks.training.loader import make_loader, sampler_for
from tasks.training.telemetry import Telemetry

GRID_IMAGES = 32


def first_batch(
    train_set: ShardDataset, global_batch: int, generator_state: torch.Tensor, imbalance: str = "none"
) -> tuple[torch.Tensor, list[int]]:
    """uint8 (N, 3, S, S) and labels of the first global batch of epoch 1, as the loop's loader yields it
    (`imbalance`: the resolved train.imbalance, whose balanced_sampler draws class by class)."""
    generator = torch.Generator()
    generator.set_state(generator_state)
    sampler = sampler_for(imbalance, train_set.labels, global_batch, World(), generator)
    loader = make_loader(train_set, sampler, num_workers=0, pin_memory=False, generator=generator)
    images, labels, _ = next(iter(loader))
    return images, labels.tolist()


def describe(augment: AugmentParams) -> str:
    parts = [f"crop {augment.crop}" + (f" {augment.crop_padding}px" if augment.crop == "pad" else "")]
    if augment.crop == "random_resized":
        parts[0] += f" scale {list(augment.scale)} ratio {[round(r, 2) for r in augment.ratio]}"
    if augment.hflip:
        parts.append("hflip")
    jitter = augment.color_jitter
    if jitter.enabled:
        parts.append(f"colour jitter b{jitter.brightness:g} c{jitter.contrast:g} s{jitter.saturation:g}")
    return ", ".join(parts)


def spread(count: int, take: int = GRID_IMAGES) -> np.ndarray:
    """`take` indices evenly over 0..count-1: a split is stored class by class, so its head is one class."""
    return np.unique(np.linspace(0, count - 1, num=min(take, count)).round().astype(np.int64))


def write_batch_grids(
    *, train: tuple[torch.Tensor, Sequence[int]], val: ShardSplit, class_names: Sequence[str],
    augment: AugmentParams, train_png: Path, val_png: Path, telemetry: Telemetry,
) -> None:  # fmt: skip
    train_images, train_labels = train[0][:GRID_IMAGES], list(train[1])[:GRID_IMAGES]
    pick = spread(len(val))
    val_images, val_labels = val.take(pick), val.labels[pick]
    plot_image_grid(train_images.numpy(), [class_names[i] for i in train_labels], train_png,
                    f"first training batch, {len(train_images)} of {len(train[0])}, as the model gets it: "
                    f"{describe(augment)}")  # fmt: skip
    plot_image_grid(val_images, [class_names[i] for i in val_labels.tolist()], val_png,
                    f"validation images, {len(val_images)} of {len(val)}, no augmentation")  # fmt: skip
    telemetry.image("data/train_batch", make_grid(train_images, nrow=8))
    telemetry.image("data/val_batch", make_grid(torch.from_numpy(np.ascontiguousarray(val_images)), nrow=8))
