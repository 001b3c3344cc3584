"""`augment.hflip: auto` where the mirror check cannot tell, on small data: two short trainings, with flips and
without, from the same seed, start weights and batches -> flips on or off, decided on the validation split.

The arms are the run's own recipe (model, optimizer, step runner, augmenter, lr schedule squeezed into
`recipe.flip_probe_steps` steps) and differ only in the flip: the augmenter draws the flip from its own number, so
the crops and the batch order are the same. Both score the same validation images, a pair per image. Flips go off
when the arm without them gets more of those images right (lost > gained, the counts McNemar's test reads; its
one-sided p is reported, not required: a probe called because the mirror check saw a hint, on a validation split of
a few hundred images, has no power for the 1-2 points flips cost real digits, and the cost of a wrong choice is
about the difference it failed to see). A tie keeps them on, the default for photos.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tasks.core.mcnemar import discordant, mcnemar_p
from tasks.core.params import TrainParams, derive_seed
from tasks.images.imaging import PreprocessSpec
from tasks.images.shards import ShardSplit
from tasks.training.augment import Augment
from tasks.training.dataset import ShardDataset
from tasks.training.distributed import World, resolve_device
from tasks.training.loader import make_loader, sampler_for
from tasks.training.models import build_model, split_logits
from tasks.training.optim import Schedule, build_optimizer
from tasks.training.precision import resolve_precision
from tasks.training.step import StepRunner
from tasks.training.telemetry import Telemetry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FlipProbe:
    steps: int  # per arm
    batch_size: int
    val_images: int
    with_flips: int  # validation images right after the arm with flips
    without_flips: int  # and after the arm without
    lost: int  # right without flips, wrong with them
    gained: int  # wrong without flips, right with them
    p: float  # one-sided McNemar (exact): flips cost validation images
    seconds: float

    @property
    def hflip(self) -> bool:
        return self.lost <= self.gained

    def why(self) -> str:
        n = max(self.val_images, 1)
        measured = (
            f"a paired probe ({self.steps} steps each, batch {self.batch_size}, the same seed and start) scored "
            f"the {self.val_images} validation images {self.with_flips / n:.3f} with flips and "
            f"{self.without_flips / n:.3f} without: flips lost {self.lost} and gained {self.gained} (p {self.p:.2g})"
        )
        if self.hflip:
            return f"{measured}, so flips stay on"
        return f"{measured}, so no flips"

    def to_json(self) -> dict[str, Any]:
        """No timing: train_run.json is byte for byte the same on a rerun (the log has the time)."""
        n = max(self.val_images, 1)
        return {
            "steps": self.steps,
            "batch_size": self.batch_size,
            "val_images": self.val_images,
            "val_accuracy_with_flips": round(self.with_flips / n, 4),
            "val_accuracy_without_flips": round(self.without_flips / n, 4),
            "lost": self.lost,
            "gained": self.gained,
            "p": float(f"{self.p:.4g}"),
            "hflip": self.hflip,
            "rule": "no flips when the arm without them gets more validation images right (lost > gained)",
        }


def _arm(params: TrainParams, flips: bool, shard_dir: Path, spec: PreprocessSpec, seed: int, steps: int,
         device: torch.device, val: ShardSplit) -> np.ndarray:  # fmt: skip
    """Per validation image: right after `steps` steps of the recipe, with or without flips."""
    # One epoch of `steps` steps: the run's schedule squeezed into the probe, its warmup the same share of it.
    warmup = float(params.warmup_epochs) / max(int(params.epochs), 1)
    arm = params.model_copy(update={"augment": params.augment.model_copy(update={"hflip": flips}), "epochs": 1,
                                    "warmup_epochs": warmup, "ema": False})  # fmt: skip
    dataset = ShardDataset(shard_dir, "train", seed=seed, augment=Augment(arm.augment))
    generator = torch.Generator().manual_seed(derive_seed(seed, "flip_probe_loader"))
    sampler = sampler_for(arm.imbalance, dataset.labels, arm.batch_size, World(), generator)
    loader = make_loader(dataset, sampler, num_workers=0, pin_memory=False, generator=generator)
    torch.manual_seed(derive_seed(seed, "flip_probe_init"))  # the same start weights in both arms
    built = build_model(arm.arch, len(spec.class_names))
    precision = resolve_precision(arm.precision, device, arm.memory_format, model=built)
    model = precision.place(built.to(device))
    optimizer = build_optimizer(model, arm)
    runner = StepRunner(
        model=model, ddp=None, optimizer=optimizer, schedule=Schedule(optimizer, arm, steps), precision=precision,
        params=arm, spec=spec, device=device, world=World(),
        telemetry=Telemetry(Path(), enabled=False, histogram_every=0, purge_step=None),
        class_counts=dataset.class_counts,  # train.imbalance's loss remedies weigh by them, as in the run
    )  # fmt: skip
    number, epoch = 0, 0
    while number < steps:
        dataset.set_epoch(epoch)
        model.train()
        for images, labels, _ in loader:
            number += 1
            runner.run(images, labels, number)
            if number == steps:
                break
        epoch += 1
    return split_logits(runner.kept, val, spec).argmax(1) == val.labels


def flip_probe(params: TrainParams, *, shard_dir: Path, spec: PreprocessSpec, seed: int,
               distributed: bool = False) -> FlipProbe | None:  # fmt: skip
    """`params`: the resolved recipe (batch, lr, schedule); `seed`: the run's; None without validation images. Under
    DDP every rank runs it on the CPU, where the same seed gives the same decision on every rank."""
    started = time.perf_counter()
    steps = params.recipe.flip_probe_steps
    device = torch.device("cpu") if distributed else resolve_device(params.device, World())
    split = ShardSplit.open(shard_dir, "val")
    if not len(split.labels):
        return None
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # the run's own stream untouched
        right = {flips: _arm(params, flips, shard_dir, spec, seed, steps, device, split) for flips in (True, False)}
    lost, gained = discordant(right[False], right[True])
    probe = FlipProbe(steps, int(params.batch_size), len(split), int(right[True].sum()), int(right[False].sum()),
                      lost, gained, mcnemar_p(lost, gained), time.perf_counter() - started)  # fmt: skip
    log.info("flip probe: %.1f s, %d steps with flips and %d without, scored on %d validation images", probe.seconds,
             steps, steps, probe.val_images)  # fmt: skip
    return probe
