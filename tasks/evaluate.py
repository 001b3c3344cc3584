"""Stage evaluate: model.pt + shards -> metrics.json (DVC metrics), the confusion plot (JSON + PNG), and the
error analysis: the test images with the highest loss (errors_gallery.png), precision and recall per class
(per_class.png), and every accepted image of every split ranked out of sample (label_errors.json: the likely
label errors, with the file each came from; training images by train_dynamics.json, tasks/core/analysis.py).
Confidence is checked too: ECE and NLL with and without model.pt's temperature, and reliability.png."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tasks.core.analysis import DURING_TRAINING, HELD_OUT, highest_loss, image_losses, label_error_ranking, log_softmax
from tasks.core.calibration_error import calibration_report, reliability
from tasks.core.cli import stage_main
from tasks.core.errors import StageError
from tasks.core.io import read_json, write_json
from tasks.core.metrics import classification_metrics, confusion_matrix
from tasks.core.params import EvaluateParams, Params
from tasks.core.paths import Paths
from tasks.core.plots import plot_confusion, plot_image_grid, plot_per_class, plot_reliability
from tasks.images.imaging import PreprocessSpec
from tasks.images.layout import data_layout
from tasks.images.shards import SPLITS, ShardSplit, load_manifest
from tasks.training.models import load_model_file, split_logits
from tasks.training.tempered import temperature_of

log = logging.getLogger(__name__)

RELIABILITY_PNG = "reliability.png"  # beside metrics.json, as dvc.yaml's evaluate stage declares it


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
    dynamics_path: Path,
    roots: dict[str, str] | None = None,
) -> EvaluateResult:
    """`roots`: the folder each manifest root was read from (tasks.images.layout), so that
    label_errors.json names files a user can open; the error-analysis files go beside metrics_path."""
    names = Paths(reports=metrics_path.parent)
    model, spec, payload = load_model_file(model_path)
    test = ShardSplit.open(shard_dir, "test")
    test.require_classes(spec.class_names, model_path)
    logits = split_logits(model, test, spec, params.batch_size)
    metrics = classification_metrics(logits, test.labels, spec.class_names)
    temperature = temperature_of(payload)
    metrics["calibration"] = calibration_report(logits, test.labels, temperature)
    predicted = logits.argmax(axis=1)
    class_names = spec.class_names
    write_json(metrics_path, metrics)
    write_json(
        confusion_json,
        [
            {"actual": class_names[a], "predicted": class_names[p]}
            for a, p in zip(test.labels.tolist(), predicted.tolist(), strict=True)
        ],
    )
    plot_confusion(confusion_matrix(test.labels, predicted, len(class_names)), class_names, confusion_png)
    plot_per_class(metrics["per_class"], names.per_class_png)
    _gallery(test, logits / temperature, class_names, params.gallery_images, names.errors_gallery)  # as served
    _reliability(logits, test.labels, temperature, metrics_path.parent / RELIABILITY_PNG)
    _label_errors(
        model, spec, shard_dir, {"test": logits}, params, roots, dynamics_path, names.label_errors, temperature
    )
    log.info("test accuracy %.4f, macro F1 %.4f on %d images -> %s",
             metrics["accuracy"], metrics["macro_f1"], metrics["num_samples"], metrics_path)  # fmt: skip
    _log_calibration(metrics["calibration"])
    return EvaluateResult(metrics["accuracy"], metrics["macro_f1"], metrics["num_samples"])


def _gallery(test: ShardSplit, logits: np.ndarray, class_names: Sequence[str], count: int, path: Path) -> None:
    """The test images the model gets most wrong: image, true class, predicted class and its probability."""
    probs = np.exp(log_softmax(logits))
    worst = highest_loss(image_losses(logits, test.labels), count)
    captions = [
        f"true {class_names[test.labels[i]]}\npred {class_names[probs[i].argmax()]} {probs[i].max():.2f}"
        for i in worst.tolist()
    ]
    plot_image_grid(test.take(worst), captions, path, f"the {len(worst)} test images with the highest loss", columns=4)


def _reliability(logits: np.ndarray, labels: np.ndarray, temperature: float, path: Path) -> None:
    """The reliability diagram: accuracy against top-1 probability per bin, without and with the temperature."""
    panels = {"uncalibrated (T = 1)": reliability(logits, labels)}
    if temperature != 1.0:
        panels[f"as served (T = {temperature:g})"] = reliability(logits, labels, temperature)
    plot_reliability(panels, path)


def _log_calibration(c: dict[str, Any]) -> None:
    if c["ece"] is None:
        return
    if c["temperature"] == 1.0:
        log.info("calibration on the test split: ECE %.4f, NLL %.4f (no temperature: model.pt has T = 1); "
                 "%.1f%% of test images have a top-1 probability below 0.5", c["ece"], c["nll"],
                 100 * c["share_below_half"])  # fmt: skip
        return
    log.info("calibration on the test split: ECE %.4f -> %.4f, NLL %.4f -> %.4f with temperature %g; "
             "%.1f%% of test images have a top-1 probability below 0.5", c["ece_uncalibrated"], c["ece"],
             c["nll_uncalibrated"], c["nll"], c["temperature"], 100 * c["share_below_half"])  # fmt: skip


def _label_errors(
    model: torch.nn.Module, spec: PreprocessSpec, shard_dir: Path, scored: dict[str, np.ndarray],
    params: EvaluateParams, roots: dict[str, str] | None, dynamics_path: Path, path: Path, temperature: float,
) -> None:  # fmt: skip
    """Every accepted image of every split, ranked by a score from a model that did not learn it. Each split is
    streamed in blocks: only the logits (images x classes) grow with the dataset, never its pixels."""
    manifest = load_manifest(shard_dir)
    entries = sorted(manifest["files"], key=lambda e: (SPLITS.index(e["split"]), e["index"]))
    for split in SPLITS:
        if split not in scored:
            scored[split] = split_logits(model, ShardSplit.open(shard_dir, split), spec, params.batch_size)
    roots = roots or {e["root"]: e["root"] for e in entries}
    dynamics = read_json(dynamics_path)
    aum, p_given = np.asarray(dynamics["aum"]), np.asarray(dynamics["p_given"])
    if len(aum) != sum(entry["split"] == "train" for entry in entries):
        raise StageError(f"{dynamics_path}: {len(aum)} training images, the shards have another train split; "
                         "rerun train (dvc repro train)")  # fmt: skip
    logits = np.concatenate([scored[split] for split in SPLITS])
    ranking = label_error_ranking(logits, entries, spec.class_names, roots, params.label_errors,
                                  train_aum=aum, train_p_given=p_given,
                                  times_trained=np.asarray(dynamics["times_trained"]),
                                  temperature=temperature)  # fmt: skip
    write_json(path, {
        "rule": f"the {len(ranking)} lowest-scoring of the {len(entries)} accepted images (evaluate.label_errors), "
                "lowest first; the score: its given label's logit minus the largest "
                f"other one, judged out of sample. Val and test images, and training images no step drew: "
                f"{HELD_OUT}. Training images: {DURING_TRAINING}, {dynamics['rule']}",
        "probabilities": f"as served: softmax(logits / T), model.pt's T = {temperature:g}; a training image's "
                         "p_given: its mean during training",
        "temperature": temperature, "images_scored": len(entries), "likely_label_errors": ranking,
    })  # fmt: skip


def _main(p: Params) -> None:
    run(
        p.evaluate,
        model_path=p.paths.model,
        shard_dir=p.paths.shards,
        metrics_path=p.paths.metrics,
        confusion_json=p.paths.confusion_json,
        confusion_png=p.paths.confusion_png,
        dynamics_path=p.paths.train_dynamics,
        roots={role: str(folder) for role, folder in data_layout(p.data, p.paths.generated).roots},
    )


def main() -> None:
    stage_main("evaluate", _main)


if __name__ == "__main__":
    main()
