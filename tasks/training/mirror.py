"""`train.augment.hflip: auto`: does mirroring an image keep its class? Measured on the train split, before training.

A flip is free data for photos (a cat facing left is a cat) and wrong data for glyphs, digits and text (a
mirrored 2 is no 2, a mirrored b is a d). Which of the two a folder is shows in its images: a cheap classifier
fitted to the training images scores held-out images and their mirror images. When the mirror images score
much worse, what tells the classes apart changes under a mirror, and flips would teach the model wrong
labels; when they score about the same, mirroring keeps the class.

The classifier is ridge regression onto one-hot labels (closed form, milliseconds) over edge orientations and
coarse colour (`features`), 5-fold over at most `SAMPLE` training images drawn with the run's seed. The decision
compares what mirroring costs with what the classifier knows above chance: `loss = (accuracy - mirrored) /
(accuracy - chance)`. Flips go off when the loss is above `MAX_LOSS`. When the classifier is barely above chance
(photos of varied scenes, at 32x32), the check cannot tell, and flips stay on: the usual choice for photos, and
what an uninformative check should not change.
Limits: it sees only what a linear model of a thumbnail sees; a class told apart by fine, mirrored detail a 32x32
image loses (the handedness of a small object in a large photo) passes as mirror-safe, and a folder too small for
the classifier to beat chance by `MIN_ABOVE_CHANCE` keeps flips whatever it holds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

SAMPLE = 4000  # training images the check reads at most
CELLS = 4  # cells per side of the 32x32 image
BINS = 9  # orientation bins
FOLDS = 5
RIDGE = 1.0  # on standardised features, per 1000 images
MIN_ABOVE_CHANCE = 0.10  # below this, the classifier knows too little to judge mirroring
MAX_LOSS = 0.35  # mirroring costs more than this share of what the classifier knows: flips off
# Measured: drawn digits 0.68-0.72; mirror-symmetric shapes, the default data and noise -0.36 to 0.16.


@dataclass(frozen=True)
class MirrorCheck:
    images: int
    chance: float  # the largest class's share
    accuracy: float  # held-out images, 5-fold
    mirrored: float  # the same images mirrored
    seconds: float

    @property
    def loss(self) -> float:
        above = self.accuracy - self.chance
        return (self.accuracy - self.mirrored) / above if above > 0 else 0.0

    @property
    def hflip(self) -> bool:
        return self.accuracy - self.chance < MIN_ABOVE_CHANCE or self.loss <= MAX_LOSS

    def why(self) -> str:
        measured = (
            f"a linear classifier of edge orientations, fitted to {self.images} training images, scores held-out "
            f"images {self.accuracy:.2f} "
            f"and their mirror images {self.mirrored:.2f} (chance {self.chance:.2f})"
        )
        if self.accuracy - self.chance < MIN_ABOVE_CHANCE:
            return f"{measured}: too close to chance to judge mirroring, so flips stay on (the default for photos)"
        if self.hflip:
            return (f"{measured}: mirroring costs {self.loss:.0%} of what it knows (at most {MAX_LOSS:.0%}), so "
                    "a mirror image keeps its class")  # fmt: skip
        return (f"{measured}: mirroring costs {self.loss:.0%} of what it knows (more than {MAX_LOSS:.0%}), so a "
                "mirror image looks like another class (glyphs, digits, text): no flips")  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """No timing: train_run.json is a DVC output, byte for byte the same on a rerun (the log has the time)."""
        return {
            "images": self.images,
            "chance": round(self.chance, 4),
            "accuracy": round(self.accuracy, 4),
            "mirrored_accuracy": round(self.mirrored, 4),
            "loss": round(self.loss, 4),
            "hflip": self.hflip,
            "rule": f"no flips when accuracy - chance >= {MIN_ABOVE_CHANCE} and "
            f"(accuracy - mirrored) / (accuracy - chance) > {MAX_LOSS}",
        }


def features(images: np.ndarray, chunk: int = 128) -> np.ndarray:
    """uint8 (N, 3, S, S) -> float32 (N, F): edge orientations and a coarse colour thumbnail.

    The image is brought to 32x32; per 8x8 cell, a histogram of gradient orientations (9 bins over 0-180
    degrees, weighted by magnitude, L2-normalised: HOG, Dalal and Triggs 2005, without blocks), which a
    mirror changes (a / stroke becomes a \\ one) and which tolerates a shift of a few pixels; and the mean
    colour of each 8x8 cell, standardised per image."""
    out = []
    for start in range(0, len(images), chunk):
        x = torch.from_numpy(np.ascontiguousarray(images[start : start + chunk])).float() / 255.0
        x = torch.nn.functional.interpolate(x, size=(32, 32), mode="area")
        grey = x.mean(1, keepdim=True)
        gx = grey[..., :, 2:] - grey[..., :, :-2]
        gy = grey[..., 2:, :] - grey[..., :-2, :]
        gx, gy = gx[..., 1:-1, :], gy[..., :, 1:-1]  # both 30x30, centred
        magnitude = torch.sqrt(gx**2 + gy**2)
        angle = torch.remainder(torch.atan2(gy, gx), torch.pi)  # unsigned orientation
        bins = torch.clamp((angle / torch.pi * BINS).long(), max=BINS - 1)
        onehot = torch.nn.functional.one_hot(bins.squeeze(1), BINS).permute(0, 3, 1, 2).float()
        weighted = onehot * magnitude
        hog = torch.nn.functional.adaptive_avg_pool2d(weighted, CELLS)  # (n, BINS, CELLS, CELLS)
        hog = hog / (hog.flatten(1).norm(dim=1).view(-1, 1, 1, 1) + 1e-6)
        colour = torch.nn.functional.adaptive_avg_pool2d(x, CELLS)
        colour = (colour - colour.mean((1, 2, 3), keepdim=True)) / (colour.std((1, 2, 3), keepdim=True) + 1e-3)
        out.append(torch.cat([hog.flatten(1), 0.5 * colour.flatten(1)], dim=1).numpy())
    return np.concatenate(out) if out else np.zeros((0, BINS * CELLS * CELLS + 3 * CELLS * CELLS), np.float32)


def ridge_predict(train_x: np.ndarray, train_y: np.ndarray, classes: int, tests: list[np.ndarray]) -> list[np.ndarray]:
    """Fit ridge onto one-hot labels on train_x; the predicted class of each row of each test array."""
    mean, std = train_x.mean(0), train_x.std(0) + 1e-3
    x = (train_x - mean) / std
    x = np.concatenate([x, np.ones((len(x), 1), x.dtype)], axis=1)
    targets = np.eye(classes, dtype=np.float64)[train_y]
    gram = x.T.astype(np.float64) @ x + RIDGE * len(x) / 1000 * np.eye(x.shape[1])
    weights = np.linalg.solve(gram, x.T.astype(np.float64) @ targets)
    predicted = []
    for test in tests:
        t = (test - mean) / std
        t = np.concatenate([t, np.ones((len(t), 1), t.dtype)], axis=1)
        predicted.append((t @ weights).argmax(1))
    return predicted


def cross_validated(
    fit_on: np.ndarray, labels: np.ndarray, classes: int, seed: int, views: tuple[np.ndarray, ...]
) -> tuple[float, list[float]]:
    """(chance, the accuracy on each view): ridge fitted on `fit_on`'s rows of 4 folds, scored on the 5th fold's
    rows of each view (`fit_on` itself, a mirrored copy, ...), over the 5 folds drawn with `seed`."""
    labels = np.asarray(labels, dtype=np.int64)
    folds = np.random.default_rng(seed).permutation(len(labels)) % FOLDS
    right = [0] * len(views)
    for fold in range(FOLDS):
        held, fit = folds == fold, folds != fold
        if held.any() and fit.any():
            predicted = ridge_predict(fit_on[fit], labels[fit], classes, [view[held] for view in views])
            for k, guess in enumerate(predicted):
                right[k] += int((guess == labels[held]).sum())
    n = len(labels)
    chance = float(np.bincount(labels, minlength=classes).max() / n) if n else 1.0
    return chance, [r / max(n, 1) for r in right]


def mirror_check(images: np.ndarray, labels: np.ndarray, classes: int, seed: int) -> MirrorCheck:
    """`images` uint8 (N, 3, S, S) of the train split (or a sample of it), `labels` (N,)."""
    started = time.perf_counter()
    flat, mirrored = features(images), features(images[..., ::-1])
    chance, (accuracy, mirrored_accuracy) = cross_validated(flat, labels, classes, seed, (flat, mirrored))
    return MirrorCheck(len(labels), chance, accuracy, mirrored_accuracy, time.perf_counter() - started)


def sample_indices(count: int, seed: int, limit: int = SAMPLE) -> np.ndarray:
    """At most `limit` of `count` indices, drawn with `seed`, in increasing order (shards read in order)."""
    if count <= limit:
        return np.arange(count)
    return np.sort(np.random.default_rng(seed).choice(count, size=limit, replace=False))
