"""Long-tailed train splits: class counts -> the training loss of train.imbalance (class-balanced weights or
logit adjustment). The sampler remedy is in tasks/training/loader.py; `auto` is decided in recipe.py.

Both losses are per-sample means, so micro-batches still sum to the global batch's mean (tasks/training/step.py),
and neither changes what the model outputs at inference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

LOSS_REMEDIES = ("class_balanced", "logit_adjust")


def imbalance_ratio(counts: Sequence[int]) -> float:
    """Largest over smallest class of the train split (a class with no image counts as one: a ratio, not inf)."""
    return max(counts) / max(1, min(counts)) if counts else 1.0


def class_balanced_weights(counts: Sequence[int], beta: float) -> torch.Tensor:
    """(C,) weights 1 / effective number of samples, (1 - beta) / (1 - beta^n_c) (Cui et al., CVPR 2019,
    "Class-Balanced Loss Based on Effective Number of Samples"), scaled to mean 1 over the classes so the
    loss keeps the plain loss's scale and the recipe's learning rate still fits."""
    n = torch.tensor([max(1, c) for c in counts], dtype=torch.float64)
    weights = (1 - beta) / (1 - beta**n)
    return (weights * len(counts) / weights.sum()).float()


def log_prior(counts: Sequence[int]) -> torch.Tensor:
    """(C,) log of each class's share of the train split (an empty class counted as one image)."""
    n = torch.tensor([max(1, c) for c in counts], dtype=torch.float64)
    return (n / n.sum()).log().float()


class ImbalanceLoss(torch.nn.Module):
    """Cross-entropy (with label smoothing) under a long-tail remedy, a mean over the samples:

    - class_balanced: each sample's loss x its class's weight (class_balanced_weights);
    - logit_adjust: the loss of logits + tau x log prior (Menon et al., ICLR 2021, "Long-tail learning via logit
      adjustment", tau = 1). A frequent class must beat its prior's head start, so the model's own logits,
      unchanged at inference, approximate the balanced error's Bayes rule.
    """

    def __init__(self, remedy: str, counts: Sequence[int] | None, *, beta: float, label_smoothing: float,
                 tau: float = 1.0) -> None:  # fmt: skip
        super().__init__()
        if remedy not in LOSS_REMEDIES:
            raise ValueError(f"train.imbalance {remedy} is not a loss (one of {', '.join(LOSS_REMEDIES)})")
        if not counts:
            raise ValueError(f"train.imbalance {remedy} needs the train split's class counts")
        self.remedy, self.label_smoothing = remedy, label_smoothing
        self.weights = class_balanced_weights(counts, beta) if remedy == "class_balanced" else None
        self.offset = tau * log_prior(counts) if remedy == "logit_adjust" else None

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """logits (B, C) float, labels (B,) -> a scalar."""
        if self.offset is not None:
            logits = logits + self.offset.to(logits.device)
        losses = torch.nn.functional.cross_entropy(logits, labels, reduction="none",
                                                   label_smoothing=self.label_smoothing)  # fmt: skip
        if self.weights is not None:
            losses = losses * self.weights.to(logits.device)[labels]
        return losses.mean()
