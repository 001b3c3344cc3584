"""Small models and step runners for the training tests: a BatchNorm-free net, seeded batches, a runner
driven step by step, and tiny train shards."""

from __future__ import annotations

from pathlib import Path

import torch

from tasks import preprocess
from tasks.core.params import Params, TrainParams
from tasks.images.imaging import PreprocessSpec
from tasks.training.distributed import World
from tasks.training.optim import Schedule, build_optimizer
from tasks.training.precision import resolve_precision
from tasks.training.step import StepOutcome, StepRunner
from tasks.training.telemetry import Telemetry
from tests.helpers.faults import FaultHooks
from tests.helpers.folders import make_imagefolder
from tests.helpers.project import TINY

CPU = torch.device("cpu")


SPEC = PreprocessSpec(image_size=8, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), class_names=("a", "b", "c"))


class Net(torch.nn.Module):
    """No BatchNorm, so micro-batches and one big batch must give the same gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.fc = torch.nn.Linear(4 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def batch(n: int = 32, size: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 3, size, size), generator=gen, dtype=torch.uint8)
    return images, torch.randint(0, 3, (n,), generator=gen)


class Steps:
    """A StepRunner driven one step at a time the way the epoch loop drives it, hooks included."""

    def __init__(self, runner: StepRunner) -> None:
        self.runner, self.number = runner, 0
        runner.hooks.on_fit_start(runner.raw)

    def __getattr__(self, name: str) -> object:
        return getattr(self.runner, name)

    def step(self, images: torch.Tensor, labels: torch.Tensor) -> StepOutcome:
        self.number += 1
        self.runner.hooks.on_step_start(self.number)
        return self.runner.run(images, labels, self.number)


def make_trainer(model: torch.nn.Module, fault: str = "", spec: PreprocessSpec = SPEC, **update: object) -> Steps:
    defaults = {"epochs": 1, "batch_size": 32, "lr": 0.1, "warmup_epochs": 0.0, "precision": "fp32",
                "backbone_lr_scale": 1.0, "freeze_epochs": 0}  # fmt: skip
    params = TrainParams.model_validate({**defaults, **update})
    optimizer = build_optimizer(model, params)
    return Steps(StepRunner(
        model=model, ddp=None, optimizer=optimizer, schedule=Schedule(optimizer, params, steps_per_epoch=10),
        precision=resolve_precision(params.precision, CPU), params=params, spec=spec, device=CPU, world=World(),
        telemetry=Telemetry(Path(), enabled=False, histogram_every=0, purge_step=None), hooks=FaultHooks.parse(fault),
    ))  # fmt: skip


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# device cpu: the byte-for-byte assertions below are CPU guarantees (CUDA runs warn_only determinism).
PARAMS = Params.model_validate(TINY | {"train": {**TINY["train"], "epochs": 2, "device": "cpu"}})


def make_shards(root: Path, classes: int = 3, per_class: int = 24, seed: int = 0) -> Path:
    make_imagefolder(root / "images", classes=classes, per_class=per_class, seed=seed)
    preprocess.run(PARAMS.preprocess, seed=PARAMS.seed, source=root / "images", out_dir=root / "shards")
    return root / "shards"
