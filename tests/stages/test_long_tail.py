"""A long-tailed train split through the train and evaluate stages: `imbalance: auto` picks the remedy and
train_run.json says why, metrics.json has the balanced accuracy, and the run summary names the worst class."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tasks import evaluate, preprocess, train
from tasks.core.io import read_json
from tasks.core.metrics import classification_metrics, worst_class
from tasks.core.params import load_params
from tasks.images.shards import ShardSplit
from tasks.tools import sanity
from tasks.tools.summary import render
from tasks.training.distributed import World
from tasks.training.start import training_start
from tasks.training.step import NonFiniteError
from tests.helpers.faults import FaultHooks
from tests.helpers.folders import make_imagefolder
from tests.helpers.project import ROOT
from tests.helpers.training import PARAMS


def test_balanced_accuracy_is_the_mean_recall_over_the_classes_present() -> None:
    # class a: 4 images, 3 right; b: 2 images, 1 right; c: 1 image, wrong; d: no test image (left out)
    labels = np.array([0, 0, 0, 0, 1, 1, 2])
    predicted = np.array([0, 0, 0, 1, 1, 0, 0])
    metrics = classification_metrics(np.eye(4)[predicted], labels, ["a", "b", "c", "d"])
    assert metrics["accuracy"] == pytest.approx(4 / 7, abs=1e-6)
    assert metrics["balanced_accuracy"] == pytest.approx((3 / 4 + 1 / 2 + 0) / 3, abs=1e-6)
    assert worst_class(metrics) == ("c", 0.0)


def test_the_summary_names_the_worst_class_and_its_recall() -> None:
    """The committed run's summary, with one class's recall lowered: the line after the test accuracy names it."""
    reports = ROOT / "reports"
    metrics = read_json(reports / "metrics.json")
    per_class = {name: {**v, "recall": 0.9} for name, v in metrics["per_class"].items()}
    rare = sorted(per_class)[3]
    per_class[rare] = {**per_class[rare], "recall": 0.53}
    text = render(
        load_params(ROOT / "params.yaml"), metrics={**metrics, "per_class": per_class, "balanced_accuracy": 0.8633},
        export=read_json(reports / "export.json"), verdict=read_json(reports / "regression.json"),
        quarantine={"accepted": 1, "quarantined": 0, "ignored": 0}, train_run=read_json(reports / "train_run.json"),
        environment={}, timings={},
    )  # fmt: skip
    lines = text.splitlines()
    line = f"  worst class   {rare}: recall 0.5300 (balanced accuracy 0.8633)"
    assert line in lines and lines[lines.index(line) - 1].startswith("  test accuracy")


@pytest.fixture(scope="module")
def long_tail(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("long-tail")
    source = make_imagefolder(root / "images", classes=3, per_class=50)
    for folder, keep in zip(sorted(source.iterdir()), (50, 20, 6), strict=True):
        for extra in sorted(folder.iterdir())[keep:]:
            extra.unlink()
    preprocess.run(PARAMS.preprocess, seed=PARAMS.seed, source=source, out_dir=root / "shards")
    return root


def test_a_long_tail_is_trained_with_the_remedy_and_scored_by_balanced_accuracy(long_tail: Path) -> None:
    shards, out = long_tail / "shards", long_tail / "run"
    assert PARAMS.train.imbalance == "auto"
    train.run(PARAMS.train, seed=PARAMS.seed, shard_dir=shards, model_path=out / "model.pt",
              history_path=out / "history.json", plot_path=out / "history.png", runs_dir=out / "runs",
              provenance={}, run_meta_path=out / "train_run.json")  # fmt: skip
    choice = read_json(out / "train_run.json")["recipe"]["choices"]["imbalance"]
    remedy = load_params(ROOT / "params.yaml").train.recipe.imbalance_remedy
    assert choice["value"] == remedy and choice["auto"] is True
    assert choice["why"].startswith("largest/smallest ") and f"{remedy}, the remedy bench_long_tail" in choice["why"]
    evaluate.run(PARAMS.evaluate, model_path=out / "model.pt", shard_dir=shards, metrics_path=out / "metrics.json",
                 confusion_json=out / "c.json", confusion_png=out / "c.png",
                 dynamics_path=out / "train_dynamics.json")  # fmt: skip
    metrics = read_json(out / "metrics.json")
    recalls = [v["recall"] for v in metrics["per_class"].values() if v["support"] > 0]
    assert metrics["balanced_accuracy"] == pytest.approx(sum(recalls) / len(recalls), abs=1e-6)


@pytest.mark.slow  # the default suite's budget (issue 59 item 4): make test-slow runs it
def test_the_balanced_sampler_resumes_to_the_same_weights(long_tail: Path, tmp_path: Path) -> None:
    """A run stopped mid-epoch (a NaN under train.nonfinite abort, after the step-2 checkpoint) and rerun ends
    with the bytes of an uninterrupted run: the balanced order is drawn again from the checkpointed generator."""
    shards = long_tail / "shards"
    params = PARAMS.train.model_copy(update={"imbalance": "balanced_sampler", "batch_size": 8, "epochs": 2,
                                             "checkpoint_every_steps": 2, "nonfinite": "abort"})  # fmt: skip

    def run(out: Path, hooks: FaultHooks | None = None) -> train.TrainResult:
        return train.run(params, seed=PARAMS.seed, shard_dir=shards, model_path=out / "model.pt",
                         history_path=out / "history.json", plot_path=out / "history.png", runs_dir=out / "runs",
                         provenance={}, run_meta_path=out / "train_run.json", hooks=hooks)  # fmt: skip

    whole = run(tmp_path / "whole")
    assert whole.resumed_from_step == 0
    with pytest.raises(NonFiniteError, match="step 3"):
        run(tmp_path / "stopped", FaultHooks.parse("nan@step:3"))
    resumed = run(tmp_path / "stopped")
    assert resumed.resumed_from_step == 2
    assert (tmp_path / "stopped" / "model.pt").read_bytes() == (tmp_path / "whole" / "model.pt").read_bytes()
    coverage = read_json(tmp_path / "whole" / "train_run.json")
    assert coverage["recipe"]["choices"]["imbalance"] == {"value": "balanced_sampler", "auto": False,
                                                          "why": "set in params.yaml"}  # fmt: skip


def test_coverage_counts_an_image_drawn_twice_in_one_batch(long_tail: Path, tmp_path: Path) -> None:
    """One batch is the whole epoch, so the balanced sampler's repeats of a rare image all fall in it: coverage
    counts them (an indexed += counted a repeat within a batch once, and said every image was seen once)."""
    shards = long_tail / "shards"
    images = len(ShardSplit.open(shards, "train").labels)
    params = PARAMS.train.model_copy(update={"imbalance": "balanced_sampler", "batch_size": images, "epochs": 1})
    start = training_start(params, seed=PARAMS.seed, shard_dir=shards, pretrained_dir=tmp_path / "none", augment=False)
    batches = [indices.numpy() for _, _, indices in start.loader(World())[1]]
    drawn = np.bincount(np.concatenate(batches), minlength=images)
    assert len(batches) == 1 and (drawn > 1).any(), "no repeat within the batch: the check would be idle"
    out = tmp_path / "run"
    train.run(params, seed=PARAMS.seed, shard_dir=shards, model_path=out / "model.pt",
              history_path=out / "history.json", plot_path=out / "history.png", runs_dir=out / "runs",
              provenance={}, run_meta_path=out / "train_run.json")  # fmt: skip
    assert read_json(out / "train_run.json")["coverage"][0] == {
        "epoch": 1, "seen_once": int((drawn == 1).sum()), "seen_more_than_once": int((drawn > 1).sum()),
        "not_seen": int((drawn == 0).sum())}  # fmt: skip


def test_sanity_trains_a_long_tail_with_its_loss_remedy(long_tail: Path, tmp_path: Path) -> None:
    """make sanity on a long-tailed split: the step runner gets the class counts its loss remedy weighs by (it
    crashed: `train.imbalance logit_adjust needs the train split's class counts`)."""
    check = PARAMS.sanity.model_copy(update={"steps": 5, "batch_size": 8, "max_loss": 100.0})
    for remedy in ("auto", "class_balanced"):
        params = PARAMS.train.model_copy(update={"imbalance": remedy})
        result = sanity.run(params, check, seed=0, shard_dir=long_tail / "shards", report_path=tmp_path / "s.json")
        assert result.passed and read_json(tmp_path / "s.json")["passed"] is True
