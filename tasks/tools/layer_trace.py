"""make inspect: one real training batch through the model with forward and backward hooks on every
module (tasks/training/trace.py). Prints a table and the flagged layers; writes reports/inspect.json.

    python -m tasks.tools.layer_trace            # the trained model (paths.model), else a fresh one
    python -m tasks.tools.layer_trace --init     # the model as training starts it (train.arch, train.init_from)
    python -m tasks.tools.layer_trace --batch 64

The batch is the first one the train stage draws, augmented as it is (the same as reports/train_batch.png),
cut to --batch images. Not a DVC stage: a tool people run when a model misbehaves.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from tasks.core.cli import stage_main
from tasks.core.errors import StageError
from tasks.core.io import write_json
from tasks.core.params import Params, derive_seed
from tasks.training.batches import first_batch
from tasks.training.models import load_model_file, normalize
from tasks.training.runtime import cpu_threads, seed_everything
from tasks.training.start import Start, start_of
from tasks.training.trace import as_json, flagged, table, trace

log = logging.getLogger(__name__)


def model_to_trace(p: Params, start: Start, init: bool) -> tuple[torch.nn.Module, str]:
    if not init and p.paths.model.is_file():
        model, trained_spec, _ = load_model_file(p.paths.model)
        if trained_spec.class_names != start.spec.class_names:
            raise StageError(f"{p.paths.model}: trained on other classes than {p.paths.shards}; rerun dvc repro train")
        return model, str(p.paths.model)
    recipe = start.params
    return start.model().module, f"a fresh {recipe.arch}" + (f" from {recipe.init_from}" if recipe.init_from else "")


def run(p: Params, *, batch: int, init: bool, report: Path) -> dict[str, list[str]]:
    seed_everything(derive_seed(p.seed, "inspect"), cpu_threads(p.train.threads, 1), torch.device("cpu"))
    start = start_of(p)
    images, labels = first_batch(
        start.dataset, start.params.batch_size, start.loader_generator().get_state(), start.params.imbalance
    )
    images, labels = images[:batch], torch.tensor(labels[:batch])  # the train stage's first batch, cut
    model, what = model_to_trace(p, start, init)
    rows = trace(model, normalize(images, start.spec), labels)
    write_json(report, {"model": what, "images": len(images), **as_json(rows)})
    print(table(rows))
    found = flagged(rows)
    log.info("%s, %d images of the first training batch: %d modules traced, %d flagged -> %s", what, len(images),
             len(rows), len(found), report)  # fmt: skip
    for name, flags in found.items():
        log.warning("%s: %s", name, ", ".join(flags))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32, help="images of the first training batch to trace")
    parser.add_argument("--init", action="store_true", help="trace the model as training starts it")
    args = parser.parse_args()

    def body(p: Params) -> None:
        run(p, batch=args.batch, init=args.init, report=p.paths.inspect_report)

    stage_main("inspect", body)


if __name__ == "__main__":
    main()
