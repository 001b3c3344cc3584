"""The learning-rate range test on a tiny model: its suggestion, measured against 100x and 1/100 of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks import lr_find, train
from tasks.core.io import read_json
from tasks.core.params import Params
from tasks.training.checkpoint import CheckpointError
from tasks.training.step import NonFiniteError
from tests.helpers.training import PARAMS, make_shards


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Params:
    root = tmp_path_factory.mktemp("lr")
    shards = make_shards(root, classes=3, per_class=32)
    paths = {"shards": str(shards), "reports": str(root / "reports"), "runs": str(root / "runs")}
    return Params.model_validate({**PARAMS.model_dump(mode="json"), "paths": paths})


def final_val_loss(p: Params, lr: float, out: Path) -> float:
    """The last epoch's validation loss; inf for a run that diverged (the stage stops on NaN/Inf)."""
    try:
        train.run(
        p.train.model_copy(update={"lr": lr, "epochs": 4, "warmup_epochs": 0.0}), seed=p.seed,
        shard_dir=p.paths.shards, model_path=out / "model.pt", history_path=out / "history.json",
        plot_path=out / "history.png", runs_dir=out / "runs", provenance={},
        )  # fmt: skip
    except (NonFiniteError, CheckpointError) as exc:
        print(f"lr {lr:g} diverged: {str(exc)[:80]}")
        return float("inf")
    return read_json(out / "history.json")[-1]["val_loss"]


def test_the_suggestion_trains_better_than_a_hundred_times_more_or_less(project: Params, tmp_path: Path) -> None:
    p = project
    sweep = lr_find.run(p, min_lr=1e-5, max_lr=10.0, steps=60, json_path=p.paths.lr_find_json,
                        png_path=p.paths.lr_find_png)  # fmt: skip
    report = read_json(p.paths.lr_find_json)
    suggested = report["suggested_lr"]
    assert report["command"] == f"dvc exp run -S train.lr={suggested:g}"
    assert len(report["lrs"]) == len(report["losses"]) == len(sweep.lrs) and report["lrs"] == sorted(report["lrs"])
    assert p.paths.lr_find_png.read_bytes()[:4] == b"\x89PNG"
    losses = {lr: final_val_loss(p, lr, tmp_path / f"lr{lr:g}") for lr in (suggested, suggested * 100, suggested / 100)}
    print(
        f"suggested lr {suggested:g}; final val loss by lr: " + ", ".join(f"{k:g}: {v:.4f}" for k, v in losses.items())
    )
    assert losses[suggested] < losses[suggested * 100] and losses[suggested] < losses[suggested / 100]
