"""`train.augment.hflip: auto`: does a mirror image keep its class? Measured on the train split, before training.

A flip is free data for photos (a car facing left is a car) and wrong data for glyphs, digits and text (a
mirrored b is a d). Which of the two a folder is shows in what mirrors do to a cheap
classifier: it is fitted twice, 5-fold over at most `SAMPLE` training images drawn with the run's seed, once on
the images and once on the images plus their mirror images labelled as the originals, and both fits score the
same held-out originals. When a mirror of one class looks like another, adding the mirrors teaches the classifier
wrong labels and held-out accuracy falls; when a mirror keeps its class (side views, textures, scenes), the
mirrors are more of the same class and accuracy holds or rises. So flips go off only when adding the mirrors
hurts: overall, costing more than `MAX_LOSS` of what the classifier knows above chance,
`loss = (accuracy - with_mirrors) / (accuracy - chance)`; or in one class, whose held-out images lost to the
mirrors outnumber those gained beyond chance (McNemar's exact test, one-sided, below `ALPHA` / classes).

The classifier votes among the 5 nearest training images (scikit-learn's KNeighborsClassifier on standardised
features, `cross_val_predict` on one shuffled KFold for both fits: paired folds), so it asks exactly
whether a mirror image lands among another class's images. A linear classifier cannot ask it: it pays for
learning two orientations of one class as much as for a mirror pair (one-way-facing objects and digits both lost
5% with one, mirror pairs such as b and d 25%).
A mirror image unlike every image of the folder (a car in profile) costs nothing: flips stay on. They
add nothing for a test split that faces one way, and help photos of things that face either way.
The check cannot tell when the classifier is barely above chance, or when a class lost more held-out images to
the mirrors than it gained at p below `HINT` but not below the corrected level (real handwritten digits: a mirrored
7 is no digit, yet only 3 of the 7s moved, p 0.12): small data from scratch then asks a training probe
(tasks/training/flip_probe.py), and anything else keeps flips on, the usual choice for photos. The features are
scikit-image's HOG of the 32x32 grey image (Dalal and Triggs 2005: 8x8-pixel cells, 9 orientations, 2x2-cell
blocks), which a mirror changes (a / stroke becomes a \\ one), and a coarse colour thumbnail. Limits: it sees a
32x32 thumbnail, so a class told apart by fine mirrored detail that 32x32 loses (the handedness of a small object
in a large photo) passes as mirror-safe; a class with few images cannot reach the per-class test's level, so on
large data one mirror pair among many classes may keep flips on: the log names the class hurt most and its p.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.model_selection import KFold, cross_val_predict
from sklearn.neighbors import KNeighborsClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from tasks.core.mcnemar import discordant, mcnemar_p

SAMPLE = 4000  # training images the check reads at most
SIDE = 32  # the thumbnail the features are computed on
FOLDS = 5
NEIGHBOURS = 5
MIN_ABOVE_CHANCE = 0.10  # below this, the classifier knows too little to judge mirroring
MAX_LOSS = 0.10  # adding the mirrors costs more than this share of what the classifier knows: flips off
ALPHA = 0.05  # or they hurt one class surely: its one-sided exact test below ALPHA / classes
HINT = 0.25  # a class that lost more held-out images than it gained at p below this: the check cannot tell
# Measured (bench/bench_small_data.py --mirror; docs/benchmarks.md): letters with mirror pairs (b d p q) lose 0.29
# overall; digits 0.05, but 24 held-out 3s turn into 8s once the mirrors join, none back (p 6e-8); symmetric shapes,
# one-way-facing objects, shapes in clutter, textures and the default data lose -0.28 to 0.01, no class below p 0.07.
# At image_size 32 (2026-12-05): real digits (load_digits) lose 0.00, 3 of the 7s moved (p 0.12), one-way-facing
# objects 6 trucks (p 0.016): both unsure, for the probe; every mirror-safe folder's worst class p 0.5 or more.


@dataclass(frozen=True)
class MirrorCheck:
    images: int
    classes: int
    chance: float  # the largest class's share
    accuracy: float  # held-out images, 5-fold, fitted on the images
    with_mirrors: float  # the same held-out images, fitted on the images and their mirror images
    mirrored: float  # the mirror images of the held-out images, fitted on the images (shown, not decided on)
    worst_class: str  # the class the mirrors hurt most surely (the smallest p)
    worst_lost: int  # its held-out images right without the mirrors and wrong with them
    worst_gained: int  # and the other way round
    worst_p: float  # one-sided exact test (McNemar's) that the mirrors hurt it: binomial(lost, lost + gained, 1/2)
    seconds: float

    @property
    def loss(self) -> float:
        above = self.accuracy - self.chance
        return (self.accuracy - self.with_mirrors) / above if above > 0 else 0.0

    @property
    def level(self) -> float:
        """The per-class test's level: ALPHA shared among the classes (Bonferroni)."""
        return ALPHA / max(self.classes, 1)

    @property
    def unsure(self) -> bool:
        return self.accuracy - self.chance < MIN_ABOVE_CHANCE

    @property
    def against(self) -> bool:
        """Sure that a mirror image looks like another class: no flips."""
        return not self.unsure and (self.loss > MAX_LOSS or self.worst_p < self.level)

    @property
    def hinted(self) -> bool:
        """Not sure, but one class lost held-out images to the mirrors (real digits: 6 lost, 1 back, p 0.062) and
        the mirrors gave no more back over the whole folder than they took (loss >= 0). Where they gave more
        (textures: 2 points more held-out images right, one class 16 lost and 8 back, p 0.076), the folder's
        evidence outweighs one class's short of its level: a mirror keeps its class."""
        return (not self.unsure and not self.against and self.loss >= 0 and self.worst_lost > self.worst_gained
                and self.worst_p < HINT)  # fmt: skip

    @property
    def decided(self) -> bool:
        """The check alone decides; otherwise small data asks a training probe (tasks/training/flip_probe.py)."""
        return not self.unsure and not self.hinted

    @property
    def hflip(self) -> bool:
        """The check's decision, and what holds when it cannot tell and nothing else decides: flips on."""
        return not self.against

    def why(self) -> str:
        measured = (
            f"a nearest-neighbour classifier of edge orientations scores held-out training images "
            f"{self.accuracy:.2f} when fitted to {self.images} images and {self.with_mirrors:.2f} when their mirror "
            f"images join them (chance {self.chance:.2f}); the mirrors took {self.worst_lost} of "
            f"{self.worst_class}'s held-out images and gave back {self.worst_gained} (p {self.worst_p:.2g})"
        )
        if self.unsure:
            return f"{measured}: too close to chance to judge mirroring"
        if self.hinted:
            return (f"{measured}: below {HINT:g} but not below {self.level:.2g} ({ALPHA:g} over {self.classes} "
                    "classes), so it cannot tell whether a mirror keeps its class")  # fmt: skip
        if self.hflip:
            return (f"{measured}: the mirrors cost {max(self.loss, 0):.0%} of what it knows (at most {MAX_LOSS:.0%}) "
                    f"and no class surely (p at least {self.level:.2g}), so a mirror keeps its class")  # fmt: skip
        if self.loss > MAX_LOSS:
            return (f"{measured}: the mirrors cost {self.loss:.0%} of what it knows (more than {MAX_LOSS:.0%}), so "
                    "a mirror image looks like another class (glyphs, digits, text): no flips")  # fmt: skip
        return (f"{measured}: p below {self.level:.2g} ({ALPHA:g} over {self.classes} classes), so a mirror image "
                f"of another class looks like {self.worst_class} (glyphs, digits, text): no flips")  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """No timing: train_run.json is a DVC output, byte for byte the same on a rerun (the log has the time)."""
        return {
            "images": self.images,
            "chance": round(self.chance, 4),
            "accuracy": round(self.accuracy, 4),
            "with_mirrors_accuracy": round(self.with_mirrors, 4),
            "mirrored_accuracy": round(self.mirrored, 4),
            "loss": round(self.loss, 4),
            "worst_class": {
                "name": self.worst_class,
                "lost": self.worst_lost,
                "gained": self.worst_gained,
                "p": float(f"{self.worst_p:.4g}"),
            },  # fmt: skip
            "hflip": self.hflip,
            "decided": self.decided,
            "rule": f"no flips when accuracy - chance >= {MIN_ABOVE_CHANCE} and ((accuracy - with_mirrors) / "
            f"(accuracy - chance) > {MAX_LOSS} or a class's p < {ALPHA} / classes); cannot tell when accuracy - "
            f"chance < {MIN_ABOVE_CHANCE} or a class lost more than it gained at p < {HINT}",
        }


def thumbnails(images: np.ndarray, chunk: int = 256) -> np.ndarray:
    """uint8 (N, 3, S, S) -> float32 (N, 3, SIDE, SIDE) in [0, 1], area-averaged."""
    out = [
        torch.nn.functional.interpolate(
            torch.from_numpy(np.ascontiguousarray(images[start : start + chunk])).float() / 255.0,
            size=(SIDE, SIDE), mode="area",
        ).numpy()
        for start in range(0, len(images), chunk)
    ]  # fmt: skip
    return np.concatenate(out) if out else np.zeros((0, 3, SIDE, SIDE), np.float32)


def features(images: np.ndarray) -> np.ndarray:
    """uint8 (N, 3, S, S) -> float32 (N, F): HOG of the grey 32x32 image (which a mirror changes: a / stroke
    becomes a \\ one) and the mean colour of each 8x8 cell, standardised per image."""
    from skimage.feature import hog

    small = thumbnails(images)
    grey = small.mean(1)
    edges = [hog(g, orientations=9, pixels_per_cell=(8, 8), cells_per_block=(2, 2)) for g in grey]
    colour = small.reshape(len(small), 3, 4, SIDE // 4, 4, SIDE // 4).mean((3, 5)).reshape(len(small), -1)
    colour = (colour - colour.mean(1, keepdims=True)) / (colour.std(1, keepdims=True) + 1e-3)
    if not edges:
        return np.zeros((0, 324 + 48), np.float32)
    return np.concatenate([np.stack(edges), 0.5 * colour], axis=1).astype(np.float32)


def classifier() -> Any:
    return make_pipeline(StandardScaler(), KNeighborsClassifier(NEIGHBOURS))


class WithMirrors(ClassifierMixin, BaseEstimator):
    """A row is [an image's features | its mirror image's]: fitted on the images (`mirrors=False`) or on the
    images and their mirror images labelled as the images; it predicts from the image's features (or, with
    `score_mirrors`, from its mirror's)."""

    def __init__(self, mirrors: bool = True, score_mirrors: bool = False) -> None:
        self.mirrors = mirrors
        self.score_mirrors = score_mirrors

    def fit(self, x: np.ndarray, y: np.ndarray) -> WithMirrors:
        half = x.shape[1] // 2
        rows = np.concatenate([x[:, :half], x[:, half:]]) if self.mirrors else x[:, :half]
        self.model_ = classifier().fit(rows, np.concatenate([y, y]) if self.mirrors else y)
        self.classes_ = self.model_.classes_
        return self

    def predict(self, x: np.ndarray) -> np.ndarray:
        half = x.shape[1] // 2
        return self.model_.predict(x[:, half:] if self.score_mirrors else x[:, :half])


def folds(seed: int) -> KFold:
    return KFold(FOLDS, shuffle=True, random_state=seed % 2**32)


def chance_of(labels: np.ndarray) -> float:
    return float(np.bincount(labels).max() / len(labels)) if len(labels) else 1.0


def mirror_check(images: np.ndarray, labels: np.ndarray, class_names: Sequence[str], seed: int) -> MirrorCheck:
    """`images` uint8 (N, 3, S, S) of the train split (or a sample of it), `labels` (N,) indices of `class_names`."""
    started = time.perf_counter()
    labels = np.asarray(labels, dtype=np.int64)
    chance, classes = chance_of(labels), len(class_names)
    if len(labels) < FOLDS * NEIGHBOURS or len(np.unique(labels)) < 2:  # too few to fit: the check cannot tell
        return MirrorCheck(len(labels), classes, chance, chance, chance, chance, "-", 0, 0, 1.0,
                           time.perf_counter() - started)  # fmt: skip
    both = np.concatenate([features(images), features(images[..., ::-1])], axis=1)
    alone, joined, mirrored = (
        cross_val_predict(WithMirrors(mirrors, score), both, labels, cv=folds(seed))
        for mirrors, score in ((False, False), (True, False), (False, True))
    )
    tests = []
    for c in np.unique(labels).tolist():
        mine = labels == c  # the class's held-out images: right without the mirrors, and with them
        lost, gained = discordant(alone[mine] == c, joined[mine] == c)
        tests.append((mcnemar_p(lost, gained), -lost, c, lost, gained))
    p, _, worst, lost, gained = min(tests)
    return MirrorCheck(len(labels), classes, chance, float((alone == labels).mean()), float((joined == labels).mean()),
                       float((mirrored == labels).mean()), str(class_names[worst]), lost, gained, p,
                       time.perf_counter() - started)  # fmt: skip


def sample_indices(count: int, seed: int, limit: int = SAMPLE) -> np.ndarray:
    """At most `limit` of `count` indices, drawn with `seed`, in increasing order (shards read in order)."""
    if count <= limit:
        return np.arange(count)
    return np.sort(np.random.default_rng(seed).choice(count, size=limit, replace=False))
