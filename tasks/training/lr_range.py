"""The learning-rate range test (Smith 2017, "Cyclical Learning Rates", section 3.3; fastai's lr_find).

Train from the recipe's starting point while the learning rate grows exponentially from `min_lr` to
`max_lr`, one optimizer step per rate, and record the loss. The loss is smoothed with an exponential
moving average (bias-corrected) whose window is 5% of the sweep, so a short sweep is not smeared;
the sweep stops early once the smoothed loss is 4x its best or not finite.

The sweep stops once the loss diverges: fastai's stop_div, the smoothed loss past 4x its best (or not
finite). Only the stretch before the loss turned for good counts: up to the lowest smoothed loss before
that point. A loss that blows up and then falls back towards chance is a model that broke, and the
rates past its lowest point are never suggested. When that stretch shows no real fall (the lowest smoothed
loss less than MIN_FALL below the first), there is no suggestion, and the recipe's lr stays.

The suggestion is fastai's "valley" rule (its default since fastai 2.4) over that stretch: take the
longest run of falling smoothed loss (the longest decreasing subsequence), and suggest the rate half-way
into its middle third: where the loss is falling steadily, well before the bottom, where a rate is
already too high for the model that training will start from. The minimum / 10 and the steepest point
are reported beside it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from tasks.images.imaging import PreprocessSpec
from tasks.training.models import normalize

WINDOW = 0.05  # the smoothing window, as a share of the sweep's steps
DIVERGE = 4.0
MIN_FALL = 0.1  # the lowest smoothed loss must be this share below the first for a suggestion
RULE = ("valley (fastai): the longest stretch of falling smoothed loss, the rate half-way into its middle "
        "third")  # fmt: skip


def valley(smoothed: Sequence[float]) -> int:
    """fastai's valley: the index half-way into the middle third of the longest decreasing subsequence."""
    n = len(smoothed)
    longest = [1] * n
    start = end = 0
    for i in range(1, n):
        for j in range(i):
            if smoothed[i] < smoothed[j] and longest[i] < longest[j] + 1:
                longest[i] = longest[j] + 1
        if longest[end] < longest[i]:
            end = i
            start = end - longest[end]
    third = (end - start) / 3
    return max(0, min(n - 1, start + int(third) + int(third / 2)))


@dataclass
class Sweep:
    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    smoothed: list[float] = field(default_factory=list)
    stopped: str = "reached max_lr"

    @property
    def lowest(self) -> int:
        """Index of the lowest smoothed loss: the end of the stretch that suggestions come from."""
        return min(range(len(self.smoothed)), key=self.smoothed.__getitem__)

    @property
    def min_loss_lr(self) -> float:
        return self.lrs[self.lowest]

    @property
    def fall(self) -> float:
        """How far the smoothed loss fell before it turned, as a share of the first smoothed loss."""
        return 1.0 - self.smoothed[self.lowest] / self.smoothed[0] if self.smoothed[0] > 0 else 0.0

    @property
    def suggestion(self) -> float | None:
        """The valley's rate within the stretch up to the lowest loss; None when the loss never really fell."""
        if self.fall < MIN_FALL or self.lowest < 2:
            return None
        return self.lrs[valley(self.smoothed[: self.lowest + 1])]

    def no_suggestion_why(self) -> str:
        return (
            f"the smoothed loss fell only {100 * self.fall:.0f}% (from {self.smoothed[0]:.3g} to "
            f"{self.smoothed[self.lowest]:.3g} at lr {self.min_loss_lr:.3g}) before it turned; a rate needs a fall of "
            f"at least {100 * MIN_FALL:.0f}%"
        )

    @property
    def min_over_ten(self) -> float:
        return self.min_loss_lr / 10

    @property
    def steepest_lr(self) -> float:
        """The rate where the smoothed loss falls fastest against log(lr) before it turns (reported, not suggested)."""
        end = self.lowest + 1
        if end < 3:
            return self.lrs[0]
        slopes = [
            (self.smoothed[i + 1] - self.smoothed[i - 1]) / math.log(self.lrs[i + 1] / self.lrs[i - 1])
            for i in range(1, end - 1)
        ]
        return self.lrs[1 + min(range(len(slopes)), key=slopes.__getitem__)]


def sweep(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    spec: PreprocessSpec, *, min_lr: float, max_lr: float, steps: int, label_smoothing: float = 0.0,
) -> Sweep:  # fmt: skip
    """`optimizer`'s groups keep their ratios to the head's rate (backbone_lr_scale); the head's rate sweeps."""
    if not 0 < min_lr < max_lr or steps < 2:
        raise ValueError(f"need 0 < min_lr < max_lr and steps >= 2, got {min_lr}, {max_lr}, {steps}")
    head = optimizer.param_groups[-1]["lr"]
    ratios = [group["lr"] / head for group in optimizer.param_groups]
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=label_smoothing)
    beta = 1 - 1 / max(1.0, WINDOW * steps)
    result, average, best = Sweep(), 0.0, math.inf
    model.train()
    for step in range(steps):
        lr = min_lr * (max_lr / min_lr) ** (step / (steps - 1))
        for group, ratio in zip(optimizer.param_groups, ratios, strict=True):
            group["lr"] = lr * ratio
        images, labels = next(batches)
        optimizer.zero_grad(set_to_none=True)
        loss = criterion(model(normalize(images, spec)), labels)
        value = float(loss.detach())
        if not math.isfinite(value):
            result.stopped = f"loss not finite at lr {lr:.3g}"
            break
        loss.backward()
        optimizer.step()
        average = beta * average + (1 - beta) * value
        smooth = average / (1 - beta ** (step + 1)) if beta else value
        result.lrs.append(lr)
        result.losses.append(value)
        result.smoothed.append(smooth)
        best = min(best, smooth)
        if step > 0 and smooth > DIVERGE * best:
            result.stopped = f"smoothed loss above {DIVERGE:g}x its best at lr {lr:.3g}"
            break
    if not result.lrs:
        raise ValueError(f"the first step's loss is not finite (lr {min_lr}): check the data and model")
    return result
