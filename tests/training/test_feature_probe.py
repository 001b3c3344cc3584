"""From weights, the recipe measures how much of the new classes the start features already know before step 1."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tasks import preprocess
from tasks.core.params import PreprocessParams, TrainParams
from tasks.images.imaging import PreprocessSpec
from tasks.training.feature_probe import embed, feature_probe
from tasks.training.models import build_model
from tasks.training.start import training_start
from tests.helpers.folders import make_imagefolder

pytestmark = pytest.mark.fast


def test_the_probe_is_recorded_and_drives_the_rates(tmp_path: Path) -> None:
    source = make_imagefolder(tmp_path / "images", classes=3, per_class=30)
    preprocess.run(PreprocessParams(image_size=32, workers=2), seed=1, source=source, out_dir=tmp_path / "shards")
    weights = tmp_path / "backbone.pth"
    torch.manual_seed(0)
    torch.save(build_model("resnet18", 5).state_dict(), weights)  # another head: only the backbone comes in
    train = TrainParams(init_from=str(weights), augment={"hflip": True})
    start = training_start(train, seed=1, shard_dir=tmp_path / "shards", pretrained_dir=tmp_path)
    probe = start.recipe.to_json()["feature_probe"]
    assert probe["images"] == len(start.dataset) and 0 <= probe["known"] <= 1
    lr_reason = next(r for r in start.recipe.reasons() if r.startswith("lr "))
    assert "a linear probe of the start weights' features scores" in lr_reason
    # Rates set by hand need no probe, and none is run.
    fixed = train.model_copy(update={"lr": 0.01, "backbone_lr_scale": 0.1})
    assert training_start(fixed, seed=1, shard_dir=tmp_path / "shards", pretrained_dir=tmp_path).recipe.probe is None


def test_features_that_separate_the_classes_are_known_and_noise_is_not() -> None:
    """A probe of a backbone whose features are the colour means knows colour-coded classes and nothing of
    classes drawn at random."""

    class MeanColour(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x.mean((2, 3)))

    spec = PreprocessSpec(image_size=8, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), class_names=("a", "b"))
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, size=200)
    tinted = (rng.integers(0, 60, size=(200, 3, 8, 8)) + labels[:, None, None, None] * 150).astype(np.uint8)
    model = MeanColour()
    assert embed(model, tinted, spec).shape == (200, 3)
    assert feature_probe(model, tinted, labels, spec, seed=0).known > 0.9
    shuffled = rng.permutation(labels)
    assert feature_probe(model, tinted, shuffled, spec, seed=0).known < 0.3
