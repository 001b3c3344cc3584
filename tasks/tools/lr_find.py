"""make lr-find: the learning-rate range test on the real loader and model (tasks/training/lr_range.py).

    python -m tasks.tools.lr_find                          # 1e-5 .. 10 over one epoch (at least 100 steps)
    python -m tasks.tools.lr_find --min-lr 1e-4 --max-lr 1 --steps 200

Starts from the model and optimizer the train stage would build (train.arch, init_from, freeze_backbone,
optimizer, momentum, weight decay, backbone_lr_scale, label_smoothing) and draws batches from its seeded,
augmented loader at the recipe's batch size. Writes reports/lr_find.json and reports/lr_find.png, and prints
the `dvc exp run -S train.lr=...` command that tries the suggestion, or, when the sweep gives none (its loss never
really fell before it diverged), says so and why: keep the recipe's lr. params.yaml is never changed.
Not a DVC stage: a tool people run by hand.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from tasks.core.cli import stage_main
from tasks.core.io import write_json
from tasks.core.params import Params, derive_seed
from tasks.core.plots import plot_lr_find
from tasks.training.distributed import World
from tasks.training.loader import steps_in_epoch
from tasks.training.lr_range import RULE, Sweep, sweep
from tasks.training.runtime import cpu_threads, seed_everything
from tasks.training.start import Start, start_of

log = logging.getLogger(__name__)


def batches(start: Start) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The train stage's loader, epoch after epoch, for as long as the sweep asks."""
    dataset = start.dataset
    _, loader, _ = start.loader(World())
    epoch = 0
    while True:
        dataset.set_epoch(epoch)
        for images, labels, _ in loader:
            yield images, labels
        epoch += 1


def run(p: Params, *, min_lr: float, max_lr: float, steps: int, json_path: Path, png_path: Path) -> Sweep:
    seed_everything(derive_seed(p.seed, "train"), cpu_threads(p.train.threads, 1), torch.device("cpu"))
    start = start_of(p)
    recipe = start.params
    steps = steps or max(100, steps_in_epoch(len(start.dataset), recipe.batch_size))
    model = start.model().module
    optimizer, _ = start.optimizer(model, recipe.model_copy(update={"lr": 1.0}))
    result = sweep(model, optimizer, batches(start), start.spec, min_lr=min_lr, max_lr=max_lr, steps=steps,
                   label_smoothing=recipe.label_smoothing)  # fmt: skip
    suggestion = float(f"{result.suggestion:.2g}") if result.suggestion is not None else None
    command = f"dvc exp run -S train.lr={suggestion:g}" if suggestion is not None else None
    why_none = None if suggestion is not None else result.no_suggestion_why()
    write_json(json_path, {
        "suggested_lr": suggestion, "no_suggestion": why_none, "rule": RULE, "min_loss_lr": result.min_loss_lr,
        "steepest_lr": result.steepest_lr, "min_loss_lr_over_10": result.min_over_ten, "stopped": result.stopped,
        "command": command,
        "arch": recipe.arch, "optimizer": recipe.optimizer, "batch_size": recipe.batch_size,
        "lrs": result.lrs, "losses": result.losses, "smoothed_losses": result.smoothed,
    })  # fmt: skip
    plot_lr_find(result.lrs, result.losses, result.smoothed, suggestion, png_path)
    log.info("%d steps, %s; smoothed loss lowest at lr %.3g (/10: %.3g), steepest at %.3g", len(result.lrs),
             result.stopped, result.min_loss_lr, result.min_over_ten, result.steepest_lr)  # fmt: skip
    if suggestion is None:
        log.info("no clear suggestion, keep the recipe's lr (%g): %s -> %s, %s", recipe.lr, why_none, json_path,
                 png_path)  # fmt: skip
        return result
    log.info("suggested lr %g (%s) -> %s, %s", suggestion, RULE, json_path, png_path)
    log.info("try it: %s", command)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--min-lr", type=float, default=1e-5)
    parser.add_argument("--max-lr", type=float, default=10.0)
    parser.add_argument("--steps", type=int, default=0,
                        help="optimizer steps, one learning rate each (0: one epoch, at least 100)")  # fmt: skip
    args = parser.parse_args()

    def body(p: Params) -> None:
        run(p, min_lr=args.min_lr, max_lr=args.max_lr, steps=args.steps, json_path=p.paths.lr_find_json,
            png_path=p.paths.lr_find_png)  # fmt: skip

    stage_main("lr-find", body)


if __name__ == "__main__":
    main()
