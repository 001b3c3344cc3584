"""make sanity: the train recipe on one fixed training batch -> does the loss reach ~0? (runs/sanity.json)

A model that cannot memorise one batch in a few hundred steps has a broken code or data path (labels,
normalisation, loss, optimizer wiring), not bad hyperparameters. It goes through the same loader,
model, precision and optimizer step as training, with augmentation and label smoothing off and a
constant learning rate. Not a DVC stage: a check people run by hand (`make sanity`).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from tasks.core.cli import stage_main
from tasks.core.errors import StageError
from tasks.core.io import write_json
from tasks.core.params import Params, Paths, SanityParams, TrainParams
from tasks.training.distributed import World, resolve_device
from tasks.training.precision import resolve_precision
from tasks.training.runtime import cpu_threads, seed_everything
from tasks.training.start import training_start
from tasks.training.step import NonFiniteError, StepRunner
from tasks.training.telemetry import Telemetry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SanityResult:
    passed: bool
    batch_size: int
    first_loss: float
    final_loss: float
    reached_at_step: int | None  # first step whose loss fell below max_loss
    steps: int
    reason: str


def run(train: TrainParams, sanity: SanityParams, *, seed: int, shard_dir: Path, report_path: Path,
        pretrained_dir: Path | None = None) -> SanityResult:  # fmt: skip
    start = training_start(train, seed=seed, shard_dir=shard_dir, pretrained_dir=pretrained_dir or Paths().pretrained,
                           stream="sanity", augment=False)  # fmt: skip
    device = resolve_device(train.device, World())
    seed_everything(start.seed, cpu_threads(train.threads, 1), device)
    batch = min(sanity.batch_size, len(start.dataset))
    _, loader, _ = start.loader(World(), batch_size=batch)
    images, labels, _ = next(iter(loader))
    # Constant lr, no smoothing (its loss floor is above 0), no average, one process, accumulation 1; a NaN is a
    # finding.
    recipe = start.params.model_copy(
        update={"lr": sanity.lr, "label_smoothing": 0.0, "ema": False, "scheduler": "plateau", "warmup_epochs": 0.0,
                "nonfinite": "abort", "batch_size": batch, "epochs": 1, "accumulation_steps": 1}
    )  # fmt: skip
    built = start.model(recipe).module
    precision = resolve_precision(recipe.precision, device, recipe.memory_format, model=built)
    model = precision.place(built.to(device))
    optimizer, schedule = start.optimizer(model, recipe)
    runner = StepRunner(
        model=model, ddp=None, optimizer=optimizer, schedule=schedule, precision=precision, params=recipe,
        spec=start.spec, device=device, world=World(),
        telemetry=Telemetry(Path(), enabled=False, histogram_every=0, purge_step=None),
        class_counts=start.class_counts,  # a long tail's loss remedy (train.imbalance) weighs by them
    )  # fmt: skip
    model.train()
    losses, reached = [], None
    reason = f"loss still above {sanity.max_loss} after {sanity.steps} steps"
    try:
        for step in range(1, sanity.steps + 1):
            out = runner.run(images, labels, step)
            losses.append(out.loss_sum / out.count)
            if step % 50 == 0:
                log.info("step %d: loss %.4f", step, losses[-1])
            if losses[-1] < sanity.max_loss:
                reached, reason = step, f"loss below {sanity.max_loss} at step {step}"
                break
    except NonFiniteError as exc:
        reason = str(exc)
        losses.append(float("nan"))
    result = SanityResult(
        reached is not None, batch, round(losses[0], 6), round(losses[-1], 6), reached, len(losses), reason
    )
    write_json(report_path, {**asdict(result), "max_loss": sanity.max_loss, "arch": recipe.arch,
                             "precision": runner.precision.name, "lr": sanity.lr})  # fmt: skip
    return result


def _main(p: Params) -> None:
    result = run(
        p.train,
        p.sanity,
        seed=p.seed,
        shard_dir=p.paths.shards,
        report_path=p.paths.sanity_report,
        pretrained_dir=p.paths.pretrained,
    )
    if not result.passed:
        raise StageError(
            f"one batch of {result.batch_size} was not memorised: loss {result.first_loss:.4f} -> "
            f"{result.final_loss:.4f} after {result.steps} steps ({result.reason}). "
            "Suspect the code or data path (labels, normalisation, loss, frozen layers), not the hyperparameters."
        )
    log.info("passed: loss %.4f -> %.4f at step %d of %d; the model can learn from this data path",
             result.first_loss, result.final_loss, result.reached_at_step, p.sanity.steps)  # fmt: skip


def main() -> None:
    stage_main("sanity", _main)


if __name__ == "__main__":
    main()
