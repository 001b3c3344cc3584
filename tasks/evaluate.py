"""Stage evaluate: model.pt + test shards -> metrics.json (DVC metrics), confusion plot (JSON + PNG)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from tasks.core.cli import stage_main
from tasks.core.io import write_json
from tasks.core.metrics import classification_metrics, confusion_matrix
from tasks.core.params import EvaluateParams, Params
from tasks.core.plots import plot_confusion
from tasks.images.shards import ShardSplit
from tasks.training.models import load_model_file, predict_logits

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvaluateResult:
    accuracy: float
    macro_f1: float
    num_samples: int


def run(
    params: EvaluateParams,
    *,
    model_path: Path,
    shard_dir: Path,
    metrics_path: Path,
    confusion_json: Path,
    confusion_png: Path,
) -> EvaluateResult:
    model, spec, _ = load_model_file(model_path)
    test = ShardSplit.open(shard_dir, "test")
    test.require_classes(spec.class_names, model_path)
    logits = predict_logits(model, test.all_images(), spec, params.batch_size)
    metrics = classification_metrics(logits, test.labels, spec.class_names)
    predicted = logits.argmax(axis=1)
    names = spec.class_names
    write_json(metrics_path, metrics)
    write_json(
        confusion_json,
        [
            {"actual": names[a], "predicted": names[p]}
            for a, p in zip(test.labels.tolist(), predicted.tolist(), strict=True)
        ],
    )
    plot_confusion(confusion_matrix(test.labels, predicted, len(names)), names, confusion_png)
    log.info("test accuracy %.4f, macro F1 %.4f on %d images -> %s",
             metrics["accuracy"], metrics["macro_f1"], metrics["num_samples"], metrics_path)  # fmt: skip
    return EvaluateResult(metrics["accuracy"], metrics["macro_f1"], metrics["num_samples"])


def _main(p: Params) -> None:
    run(
        p.evaluate,
        model_path=p.paths.model,
        shard_dir=p.paths.shards,
        metrics_path=p.paths.metrics,
        confusion_json=p.paths.confusion_json,
        confusion_png=p.paths.confusion_png,
    )


def main() -> None:
    stage_main("evaluate", _main)


if __name__ == "__main__":
    main()
