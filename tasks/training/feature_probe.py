"""How far the new data is from the weights training starts from: a linear probe of the backbone's features.

The start weights' backbone (train.pretrained or init_from, the head aside) embeds at most `SAMPLE` training
images; a ridge classifier on those embeddings (scikit-learn's RidgeClassifier on standardised features,
scored with `cross_val_score` over 5 shuffled folds) says how much of the new classes the features already
separate: `known = (accuracy - chance) / (1 - chance)`, 1 when a linear head on the frozen features is enough,
0 when they carry nothing of the new classes. Linear probing before fine-tuning is Kumar et al. 2022 ("Fine-Tuning
can Distort Pretrained Features"); the fine-tuning recipe (tasks/training/recipe.py) takes its rates from it: near
data keeps the features (a low rate, the backbone slower), far data relearns them (the from-scratch rate).
One forward pass over the sample in eval mode, then closed-form fits: seconds on a CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from sklearn.linear_model import RidgeClassifier
from sklearn.model_selection import cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from tasks.images.imaging import PreprocessSpec
from tasks.training.mirror import chance_of, folds
from tasks.training.models import head_name, normalize

SAMPLE = 1000  # training images embedded at most
BATCH = 128
RIDGE = 1.0  # RidgeClassifier's alpha on standardised features
MIN_PER_CLASS = 10  # fewer training images in a class: too few for 5-fold to judge (each fold fits on ~8 of them)
# Measured (bench/bench_finetune.py --probe-only --per-class 5 60): near data known 0.78 at 60 images per class
# and 0.10 at 5, which would have picked the from-scratch rate for data the features already separate.


@dataclass(frozen=True)
class FeatureProbe:
    images: int
    chance: float
    accuracy: float  # 5-fold, a linear head on the frozen features
    seconds: float
    smallest_class: int = MIN_PER_CLASS  # training images of the rarest class in the sample

    @property
    def judged(self) -> bool:
        """False: too few images per class for the probe to say anything; the recipe takes the data as near."""
        return self.smallest_class >= MIN_PER_CLASS

    @property
    def known(self) -> float:
        """The share of the way from chance to perfect that the frozen features already go."""
        return max(0.0, (self.accuracy - self.chance) / (1 - self.chance)) if self.chance < 1 else 1.0

    def to_json(self) -> dict[str, Any]:
        # No timing: train_run.json is a DVC output, byte for byte the same on a rerun (the log has the time).
        return {"images": self.images, "chance": round(self.chance, 4), "accuracy": round(self.accuracy, 4),
                "known": round(self.known, 4), "smallest_class": self.smallest_class,
                "judged": self.judged}  # fmt: skip

    def line(self) -> str:
        if not self.judged:
            return (f"a linear probe of the start weights' features cannot judge {self.images} training images: the "
                    f"rarest class has {self.smallest_class}, fewer than {MIN_PER_CLASS} (5-fold would fit on a few "
                    "of each)")  # fmt: skip
        return (f"a linear probe of the start weights' features scores {self.accuracy:.2f} on {self.images} "
                f"training images, 5-fold (chance {self.chance:.2f}): they already know {self.known:.0%} of the "
                "new classes")  # fmt: skip


@torch.no_grad()
def embed(model: torch.nn.Module, images: np.ndarray, spec: PreprocessSpec) -> np.ndarray:
    """uint8 (N, 3, S, S) -> float32 (N, D): what the head of `model` receives, in eval mode on the CPU."""
    head = dict(model.named_modules())[head_name(model)]
    seen: list[torch.Tensor] = []
    handle = head.register_forward_pre_hook(lambda _module, args: seen.append(args[0].detach().flatten(1)))
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(images), BATCH):
            batch = torch.from_numpy(np.ascontiguousarray(images[start : start + BATCH]))
            model(normalize(batch, spec))
    finally:
        handle.remove()
        model.train(was_training)
    return torch.cat(seen).float().numpy() if seen else np.zeros((0, 0), np.float32)


def feature_probe(
    model: torch.nn.Module, images: np.ndarray, labels: np.ndarray, spec: PreprocessSpec, seed: int
) -> FeatureProbe:
    started = time.perf_counter()
    features = embed(model, images, spec)
    labels = np.asarray(labels, dtype=np.int64)
    chance = chance_of(labels)
    smallest = int(np.bincount(labels, minlength=len(spec.class_names)).min()) if len(labels) else 0
    if smallest < MIN_PER_CLASS or len(spec.class_names) < 2:  # too few to fit and score: taken as near
        return FeatureProbe(len(labels), chance, chance, time.perf_counter() - started, smallest)
    probe = make_pipeline(StandardScaler(), RidgeClassifier(alpha=RIDGE))
    accuracy = float(cross_val_score(probe, features, labels, cv=folds(seed)).mean())
    return FeatureProbe(len(labels), chance, accuracy, time.perf_counter() - started, smallest)
