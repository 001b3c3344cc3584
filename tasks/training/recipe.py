"""The training recipe that scales with the data: train params with `auto` values + the size of the
train split -> concrete batch size, learning rate, epochs and warmup, each with the reason it was chosen.

A fixed epoch count is a fixed number of optimizer steps only for one dataset size: 6 epochs of
batch 64 are 750 steps on the default 8,000 images and 18 steps on 160. So `auto` asks for enough
steps instead (`recipe.min_steps`, and never fewer than `recipe.min_epochs` epochs), a batch that
leaves an epoch several steps (`recipe.min_steps_per_epoch`), a learning rate scaled linearly with
the batch (Goyal et al. 2017, "Accurate, Large Minibatch SGD") and a warmup that is a share of the
run. A value set in params.yaml is used as written. On the default data `auto` resolves to batch 64,
lr 0.1, 6 epochs and 0.5 warmup epochs: the recipe that reached 0.948 there.

Starting from weights (train.pretrained or init_from), `auto` is a fine-tuning recipe instead, in the
order of fastai's `fine_tune` and the seed's advice for small data: `recipe.finetune_freeze_epochs` epochs
that train the head alone (the backbone frozen), then every layer. Its rates follow how far the data is
from the weights, as a linear probe of the start features measures it (tasks/training/feature_probe.py):
near data (the probe knows `recipe.finetune_near_known` of the new classes) gets `recipe.finetune_lr_*`
with the backbone at `recipe.finetune_backbone_lr_scale` of the head's, far data (`finetune_far_known`)
the from-scratch rate with the backbone at the head's, data between a geometric blend of the two
(bench/bench_finetune.py measured it against hand-set rates).

A small train split from scratch (fewer than `recipe.small_data_images` images) is where a classical baseline
(an SVM on HOG features) beat the plain recipe. Of the candidates bench/bench_small_data.py measured there
(RandAugment, label smoothing, an average of the weights, a longer schedule), only the longer schedule helped:
`auto` trains at least `recipe.small_min_steps` steps instead of `recipe.min_steps`. The others are options
(`augment.policy`, `label_smoothing`, `ema`), off unless set.

A long-tailed train split (largest/smallest class at least `recipe.imbalance_ratio`) gets `recipe.imbalance_remedy`
under `imbalance: auto` (tasks/training/imbalance.py; bench/bench_long_tail.py measured the candidates).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tasks.core.params import AUTO, RecipeParams, TrainParams
from tasks.training.feature_probe import FeatureProbe
from tasks.training.imbalance import imbalance_ratio
from tasks.training.loader import steps_in_epoch
from tasks.training.mirror import MirrorCheck

if TYPE_CHECKING:  # flip_probe imports the loader, which imports this module
    from tasks.training.flip_probe import FlipProbe


@dataclass(frozen=True)
class Choice:
    key: str  # the train.* key
    value: int | float | bool | str
    auto: bool  # chosen by the recipe (params.yaml said auto); False: taken as written
    why: str

    def to_json(self) -> dict[str, Any]:
        return {"value": self.value, "auto": self.auto, "why": self.why}


@dataclass(frozen=True)
class Recipe:
    params: TrainParams  # every auto value replaced by the chosen one
    train_images: int
    steps_per_epoch: int
    choices: tuple[Choice, ...]
    mirror: MirrorCheck | None = None  # the measurement behind augment.hflip auto
    probe: FeatureProbe | None = None  # from weights: how much of the new classes the start features know
    flips: FlipProbe | None = None  # small data, the mirror check unsure: the training probe that decided hflip

    @property
    def total_steps(self) -> int:
        return int(self.params.epochs) * self.steps_per_epoch

    def summary(self) -> str:
        """One line for the log, e.g. "162 training images: batch 16, lr 0.025, 40 epochs = 400 steps"."""
        p = self.params
        return (
            f"{self.train_images} training images: batch {p.batch_size}, lr {p.lr:g}, {p.epochs} epochs x "
            f"{self.steps_per_epoch} steps = {self.total_steps} steps, warmup {p.warmup_epochs:.3g} epochs"
            + (f", head alone for {p.freeze_epochs} epoch(s), backbone lr x {p.backbone_lr_scale:g}"
               if p.from_weights else "")
        )  # fmt: skip

    def reasons(self) -> list[str]:
        return [f"{c.key} {_shown(c.value)} ({'auto' if c.auto else 'params.yaml'}: {c.why})" for c in self.choices]

    def to_json(self) -> dict[str, Any]:
        return {
            "train_images": self.train_images,
            "steps_per_epoch": self.steps_per_epoch,
            "total_steps": self.total_steps,
            "summary": self.summary(),
            "choices": {c.key: c.to_json() for c in self.choices},
            "mirror_check": self.mirror.to_json() if self.mirror else None,
            "feature_probe": self.probe.to_json() if self.probe else None,
            "flip_probe": self.flips.to_json() if self.flips else None,
        }


def _farness(r: RecipeParams, probe: FeatureProbe | None) -> float:
    """0 for near data (the fine-tune rates), 1 for far (the from-scratch rate, backbone at the head's)."""
    if probe is None or not probe.judged:
        return 0.0
    return min(1.0, max(0.0, (r.finetune_near_known - probe.known) / (r.finetune_near_known - r.finetune_far_known)))


def _distance_words(far: float) -> str:
    if far == 0:
        return "near data: the features are kept"
    if far == 1:
        return "far data: the features are relearnt at the from-scratch rate"
    return f"data {far:.0%} of the way from near to far"


def _shown(value: int | float | bool | str) -> str:
    if isinstance(value, str):
        return value
    return ("on" if value else "off") if isinstance(value, bool) else f"{value:g}"


def _floor_pow2(x: float) -> int:
    return 1 << max(0, math.floor(math.log2(x))) if x >= 1 else 1


def resolve(
    params: TrainParams, train_images: int, processes: int = 1, mirror: MirrorCheck | None = None,
    probe: FeatureProbe | None = None, flip_probe: Callable[[TrainParams], FlipProbe | None] | None = None,
    class_counts: Sequence[int] | None = None,
) -> Recipe:  # fmt: skip
    """Concrete values for every `auto` of `params`, for a train split of `train_images` samples
    trained by `processes` processes; `mirror`: the check `augment.hflip: auto` is decided by; `probe`: how much
    of the new classes the start weights already know (from weights only; None: they are taken as near);
    `flip_probe`: trains the recipe given with and without flips, for small data the mirror check cannot judge;
    `class_counts`: images per class of the train split, which `imbalance: auto` is decided by (None: not known)."""
    r, parts = params.recipe, processes * params.accumulation_steps
    choices: list[Choice] = []
    small = not params.from_weights and train_images < r.small_data_images

    if params.batch_size == AUTO:
        wanted = min(r.max_batch, _floor_pow2(train_images / r.min_steps_per_epoch))
        batch = max(r.min_batch, wanted)
        why = f"{r.max_batch} at most, and at least {r.min_steps_per_epoch} steps per epoch"
        if batch > wanted:
            why = f"recipe.min_batch {r.min_batch}: BatchNorm needs a few samples per batch"
        if batch > train_images:
            batch, why = train_images, f"the whole train split ({train_images} images)"
        rounded = max(parts, batch // parts * parts)
        if rounded != batch:
            why += f"; rounded to a multiple of {parts} (processes x accumulation_steps)"
        batch = rounded
        choices.append(Choice("batch_size", batch, True, why))
    else:
        batch = int(params.batch_size)
        choices.append(Choice("batch_size", batch, False, "set in params.yaml"))
    steps_per_epoch = steps_in_epoch(train_images, batch)

    tuning = params.from_weights
    start = f"fine-tuning from {'train.pretrained' if params.pretrained else 'train.init_from'}" if tuning else ""
    far = _farness(r, probe) if tuning else 0.0
    distance = "" if not tuning or probe is None else f"; {probe.line()}, so {_distance_words(far)}"
    if params.lr == AUTO:
        key = f"recipe.{'finetune_lr' if tuning else 'base_lr'}_{params.optimizer}"
        base = getattr(r, key.removeprefix("recipe."))
        why = f"{key} {base:g} x batch {batch} / {r.max_batch} (linear scaling)"
        if far > 0:
            scratch_key = f"recipe.base_lr_{params.optimizer}"
            scratch = getattr(r, scratch_key.removeprefix("recipe."))
            base = base ** (1 - far) * scratch**far
            why = (f"{key} moved {far:.0%} of the way (geometrically) to {scratch_key} {scratch:g}: {base:.3g} x "
                   f"batch {batch} / {r.max_batch} (linear scaling)")  # fmt: skip
        lr = base * batch / r.max_batch
        choices.append(Choice("lr", lr, True, f"{start}: {why}{distance}" if tuning else why))
    else:
        lr = float(params.lr)
        choices.append(Choice("lr", lr, False, "set in params.yaml"))

    if params.epochs == AUTO:
        key, min_steps = ("recipe.small_min_steps", r.small_min_steps) if small else ("recipe.min_steps", r.min_steps)
        needed = math.ceil(min_steps / steps_per_epoch)
        epochs = max(r.min_epochs, needed)
        why = (
            f"{needed} epochs of {steps_per_epoch} steps reach {key} {min_steps}"
            if epochs == needed
            else f"recipe.min_epochs {r.min_epochs} ({epochs * steps_per_epoch} steps, at least {key} {min_steps})"
        )
        if small:
            why += (f" (small data from scratch: {train_images} training images, fewer than recipe.small_data_images "
                    f"{r.small_data_images})")  # fmt: skip
        choices.append(Choice("epochs", epochs, True, why))
    else:
        epochs = int(params.epochs)
        choices.append(Choice("epochs", epochs, False, "set in params.yaml"))

    if params.warmup_epochs == AUTO:
        warmup = epochs * r.warmup_fraction
        choices.append(
            Choice("warmup_epochs", warmup, True, f"recipe.warmup_fraction {r.warmup_fraction:g} of the run")
        )
    else:
        warmup = float(params.warmup_epochs)
        choices.append(Choice("warmup_epochs", warmup, False, "set in params.yaml"))

    if params.backbone_lr_scale == AUTO:
        scale = r.finetune_backbone_lr_scale ** (1 - far) if tuning else 1.0
        why = (f"{start}: recipe.finetune_backbone_lr_scale" + (f" moved {far:.0%} of the way to 1" if far else "")
               if tuning else "from scratch: every layer at the head's rate")  # fmt: skip
        choices.append(Choice("backbone_lr_scale", scale, True, why))
    else:
        scale = float(params.backbone_lr_scale)
        choices.append(Choice("backbone_lr_scale", scale, False, "set in params.yaml"))

    if params.freeze_epochs == AUTO:
        frozen = min(r.finetune_freeze_epochs, epochs - 1) if tuning and not params.freeze_backbone else 0
        why = (f"{start}: recipe.finetune_freeze_epochs, the head alone before every layer" if frozen
               else "freeze_backbone: the head alone for the whole run" if params.freeze_backbone
               else "from scratch: every layer from the start")  # fmt: skip
        choices.append(Choice("freeze_epochs", frozen, True, why))
    else:
        frozen = int(params.freeze_epochs)
        choices.append(Choice("freeze_epochs", frozen, False, "set in params.yaml"))

    imbalance = _imbalance(params, class_counts)  # before the flip probe, which trains with its remedy
    flips = None
    if params.augment.hflip == AUTO:
        if mirror is None:
            raise ValueError("augment.hflip auto is decided by a mirror check of the training images: pass one")
        hflip, why = mirror.hflip, mirror.why()
        if not mirror.decided:  # small data: two short trainings decide; else flips stay on, the default for photos
            steps = r.flip_probe_steps
            if small and steps and flip_probe is not None:
                flips = flip_probe(params.model_copy(update={"batch_size": batch, "lr": lr, "epochs": epochs,
                                                             "warmup_epochs": warmup, "backbone_lr_scale": scale,
                                                             "freeze_epochs": frozen,
                                                             "imbalance": imbalance.value}))  # fmt: skip
            if flips is not None:
                hflip, why = flips.hflip, f"{why}; {flips.why()}"
            else:
                unasked = ("the training probe is for small data from scratch only" if not small
                           else "recipe.flip_probe_steps is 0" if not steps
                           else "no validation images to probe on" if flip_probe is not None
                           else "no probe asked")  # fmt: skip
                why = f"{why}; flips stay on, the default for photos ({unasked})"  # fmt: skip
        choices.append(Choice("augment.hflip", hflip, True, why))
    else:
        hflip = bool(params.augment.hflip)
        choices.append(Choice("augment.hflip", hflip, False, "set in params.yaml"))

    if params.ema_decay == AUTO:
        span = max(1.0, r.ema_span * epochs * steps_per_epoch)
        decay = round(1 - 1 / span, 6)
        choices.append(Choice("ema_decay", decay, True, f"1 - 1 / (recipe.ema_span {r.ema_span:g} x "
                                                        f"{epochs * steps_per_epoch} steps)"))  # fmt: skip
    else:
        decay = float(params.ema_decay)
        choices.append(Choice("ema_decay", decay, False, "set in params.yaml"))

    choices.append(imbalance)

    augment = params.augment.model_copy(update={"hflip": hflip})
    resolved = params.model_copy(update={"batch_size": batch, "lr": lr, "epochs": epochs, "warmup_epochs": warmup,
                                         "backbone_lr_scale": scale, "freeze_epochs": frozen,
                                         "ema_decay": decay, "imbalance": imbalance.value,
                                         "augment": augment})  # fmt: skip
    return Recipe(resolved, train_images, steps_per_epoch, tuple(choices), mirror, probe, flips)


def _imbalance(params: TrainParams, counts: Sequence[int] | None) -> Choice:
    """train.imbalance: as written, or under auto the remedy for a long tail and none for a split near balance."""
    if params.imbalance != AUTO:
        return Choice("imbalance", params.imbalance, False, "set in params.yaml")
    if not counts:
        return Choice("imbalance", "none", True, "the train split's class counts are not known")
    r, ratio = params.recipe, imbalance_ratio(counts)
    largest, smallest = max(counts), min(counts)
    if ratio >= r.imbalance_ratio:
        why = (f"largest/smallest {ratio:.1f} >= recipe.imbalance_ratio {r.imbalance_ratio:g} ({largest} and "
               f"{smallest} training images): {r.imbalance_remedy}, the remedy bench_long_tail measured "
               "best")  # fmt: skip
        return Choice("imbalance", r.imbalance_remedy, True, why)
    why = (f"largest/smallest {ratio:.1f} < recipe.imbalance_ratio {r.imbalance_ratio:g} ({largest} and {smallest} "
           "training images): near enough to balanced")  # fmt: skip
    return Choice("imbalance", "none", True, why)
