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
    assert probe["images"] == len(start.dataset)
    assert probe["known"] == round(start.recipe.probe.known, 4)
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


class SmallNet(torch.nn.Module):
    """A backbone small enough to train in seconds, with a head named `fc` as torchvision's ResNets have."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        for cin, cout in ((3, 16), (16, 32), (32, 64)):
            layers += [torch.nn.Conv2d(cin, cout, 3, padding=1), torch.nn.BatchNorm2d(cout), torch.nn.ReLU(),
                       torch.nn.MaxPool2d(2)]  # fmt: skip
        self.features = torch.nn.Sequential(*layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
        self.fc = torch.nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


def test_a_backbone_trained_on_the_classes_knows_them_and_a_random_one_does_not(tmp_path: Path) -> None:
    """Shapes in clutter: a backbone trained on other images of the same classes separates them linearly; the same
    backbone untrained leaves the probe much nearer chance (random convolutions keep some of a shape: Saxe et al.
    2011, "On Random Weights and Unsupervised Feature Learning")."""
    from tasks.images.shards import load_manifest
    from tasks.training.dataset import ShardDataset
    from tests.helpers.folders import draw_offcentre_folder

    source = draw_offcentre_folder(tmp_path / "shapes", classes=3, per_class=120, seed=5, max_ratio=1.5, cluttered=True)
    preprocess.run(PreprocessParams(image_size=32, workers=2, val_fraction=0.45, test_fraction=0.05), seed=1,
                   source=source, out_dir=tmp_path / "shards")  # fmt: skip
    spec = PreprocessSpec.model_validate(load_manifest(tmp_path / "shards")["spec"])
    train, held = ShardDataset(tmp_path / "shards", "train", seed=0), ShardDataset(tmp_path / "shards", "val", seed=0)
    images = torch.from_numpy(train.data.take(np.arange(len(train))))
    targets = torch.from_numpy(train.labels.astype(np.int64))
    torch.manual_seed(0)
    random = SmallNet(3)
    trained = SmallNet(3)
    trained.load_state_dict(random.state_dict())
    optimizer = torch.optim.Adam(trained.parameters(), lr=3e-3)
    from tasks.training.models import normalize

    for step in range(300):
        batch = torch.from_numpy(np.random.default_rng(step).choice(len(images), 32, replace=False))
        flips = torch.rand(()) < 0.5  # shapes are mirror-symmetric
        x = normalize(images[batch].flip(-1) if flips else images[batch], spec)
        loss = torch.nn.functional.cross_entropy(trained(x), targets[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    probe_images, probe_labels = held.data.take(np.arange(len(held))), held.labels
    known, unknown = (feature_probe(m, probe_images, probe_labels, spec, seed=0) for m in (trained, random))
    assert known.images == len(held) >= 100
    assert known.known > 0.85, known  # measured 0.95
    assert unknown.known < 0.5, unknown  # measured 0.39
