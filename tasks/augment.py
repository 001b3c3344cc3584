"""Augmentation on uint8 (3, H, W) tensors, seeded per sample so it never depends on worker order."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tasks.params import AugmentParams, derive_seed


class Augment:
    """Pad-and-random-crop and horizontal flip, drawn from a generator seeded by the sample key."""

    def __init__(self, params: AugmentParams) -> None:
        self.hflip, self.padding = params.hflip, params.crop_padding

    def __call__(self, image: torch.Tensor, key: tuple[object, ...]) -> torch.Tensor:
        gen = torch.Generator().manual_seed(derive_seed(*key))
        _, height, width = image.shape
        if self.padding:
            pad = self.padding
            padded = F.pad(image.unsqueeze(0).float(), (pad, pad, pad, pad), mode="reflect")[0]
            top, left = torch.randint(0, 2 * pad + 1, (2,), generator=gen).tolist()
            image = padded[:, top : top + height, left : left + width].to(torch.uint8)
        if self.hflip and torch.rand((), generator=gen).item() < 0.5:
            image = image.flip(-1)
        return image
