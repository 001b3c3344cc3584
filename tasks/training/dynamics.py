"""Training dynamics per training image: what the model said about each image while it learned it.

For the label-error list, an image must be judged by a model that has not memorised it. The final model
has memorised its training images, mislabeled ones included. The area under the margin (Pleiss et al.
2020, "Identifying Mislabeled Data using the Area Under the Margin Ranking") is recorded during training
instead, from the forward pass that training runs anyway: each time an image is trained on, the margin
between the logit of its given label and the largest other logit. Averaged over the run, an image whose
label is right has a large positive margin (learned early, from its class's other images); a mislabeled
one stays low or negative until the model memorises it near the end. Also the mean probability of the
given label. Sums and counts per image, summed over DDP ranks, saved in every checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch

from tasks.core.metrics import DIGITS
from tasks.training.distributed import all_reduce_counts

RULE = ("area under the margin (Pleiss et al. 2020): the mean, over every time the image was trained on, of "
        "its given label's logit minus the largest other logit, from the training forward pass")  # fmt: skip


class Dynamics:
    def __init__(self, samples: int) -> None:
        self.margin_sum = torch.zeros(samples, dtype=torch.float64)
        self.p_given_sum = torch.zeros(samples, dtype=torch.float64)
        self.count = torch.zeros(samples, dtype=torch.int32)

    def add(self, indices: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """One step's training logits (B, C) for the images `indices` with their given `labels` (B,)."""
        z = logits.detach().to("cpu", torch.float64)
        labels = labels.to("cpu").view(-1, 1)
        given = z.gather(1, labels).squeeze(1)
        other = z.scatter(1, labels, float("-inf")).amax(1)
        p_given = torch.softmax(z, 1).gather(1, labels).squeeze(1)
        finite = torch.isfinite(given) & torch.isfinite(other)  # a step that met a NaN counts for nothing
        where = indices.to("cpu")[finite]
        self.margin_sum.index_add_(0, where, (given - other)[finite])
        self.p_given_sum.index_add_(0, where, p_given[finite])
        self.count.index_add_(0, where, torch.ones_like(where, dtype=torch.int32))

    def reduced(self) -> dict[str, torch.Tensor]:
        """Every rank's sums together (a collective: every rank calls it)."""
        return {name: all_reduce_counts(getattr(self, name)) for name in ("margin_sum", "p_given_sum", "count")}

    def load(self, state: dict[str, torch.Tensor], *, is_main: bool) -> None:
        """From a checkpoint, which holds every rank's sums: the main rank takes them, the others start at 0."""
        for name, tensor in state.items():
            getattr(self, name).copy_(tensor if is_main else torch.zeros_like(tensor))

    @staticmethod
    def to_json(state: dict[str, torch.Tensor]) -> dict[str, Any]:
        """train_dynamics.json: per training image (the train split's index order), from reduced sums."""
        count = state["count"].clamp(min=1).double()
        r = lambda t: [round(float(x), DIGITS) for x in t]  # noqa: E731
        return {
            "rule": RULE,
            "aum": r(state["margin_sum"] / count),
            "p_given": r(state["p_given_sum"] / count),
            "times_trained": state["count"].tolist(),
        }
