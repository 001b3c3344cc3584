"""Augmentation on uint8 (N, 3, H, W) batches, seeded per sample so it never depends on worker order.

Each sample's random numbers are a pure function of its key (seed, epoch, index): a counter-based
hash (splitmix64) of the key, vectorised over the batch. Every image operation
acts on one sample at a time or per pixel, so a sample comes out the same alone or in any batch:
results are identical for any num_workers, batch size or sampler.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from numpy.lib.stride_tricks import sliding_window_view

from tasks.core.params import AugmentParams

_ATTEMPTS = 10  # random-resized-crop draws before falling back to a center crop (as torchvision)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_START = np.uint64(0x243F6A8885A308D3)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64 (Steele et al. 2014): a bijective 64-bit mixer; uint64 arithmetic wraps by design."""
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniforms(keys: list[tuple[int, ...]], count: int) -> np.ndarray:
    """(len(keys), count) float64 in [0, 1), a pure function of each key (non-negative ints).

    Counter-based: the key is folded into one 64-bit state, and draw d is mix(state + d·φ), so
    the numbers of a sample never depend on the other keys in the batch.
    """
    try:
        parts = np.array(keys, dtype=np.uint64).reshape(len(keys), -1)
    except (OverflowError, ValueError, TypeError) as exc:
        raise ValueError(f"augmentation keys must be tuples of non-negative ints: {exc}") from None
    state = np.full(len(keys), _START, dtype=np.uint64)
    for column in parts.T:
        state = _mix(state ^ column)
    z = _mix(state[:, None] + np.arange(count, dtype=np.uint64)[None, :] * _GOLDEN)
    return (z >> np.uint64(11)).astype(np.float64) / 2.0**53


_JITTER = 0xC0102  # appended to a sample's key: colour jitter draws from a stream of its own
_POLICY = 0x9011C  # and the policy (RandAugment, TrivialAugmentWide) from another
_GREY = (0.299, 0.587, 0.114)  # ITU-R 601 luma, as torchvision's rgb_to_grayscale


class Augment:
    """Random crop (reflect-pad-and-crop, or random-resized-crop), horizontal flip, a policy (torchvision's
    RandAugment or TrivialAugmentWide) and colour jitter, per sample.

    Draw 0 decides the flip; pad mode uses draws 1-2 for the offsets; random_resized uses draws
    1-40 for up to ten (area, ratio, top, left) attempts. Colour jitter and the policy draw from the key
    extended by a constant each, so turning one on leaves the crops and flips as they were. The policy is
    torchvision's own transform run on one image at a time under torch's generator seeded from the sample's
    key (inside `torch.random.fork_rng`, so the training process's own random stream is untouched).
    """

    def __init__(self, params: AugmentParams) -> None:
        if not isinstance(params.hflip, bool):  # `auto` is the recipe's to resolve (tasks/training/mirror.py)
            raise ValueError(f"augment.hflip {params.hflip!r}: resolve it first (tasks.training.recipe.resolve)")
        self.params = params
        self.policy = _policy(params)

    def __call__(self, image: torch.Tensor, key: tuple[int, ...]) -> torch.Tensor:
        """One uint8 (3, H, W) image; the same as its row in `batch`."""
        return self.batch(image.unsqueeze(0), [key])[0]

    def batch(self, images: torch.Tensor, keys: list[tuple[int, ...]]) -> torch.Tensor:
        """uint8 (N, 3, H, W) -> a new uint8 (N, 3, H, W); keys[i] seeds row i."""
        p = self.params
        if len(keys) != len(images):
            raise ValueError(f"{len(images)} images but {len(keys)} keys")
        u = uniforms(keys, 1 + 4 * _ATTEMPTS if p.crop == "random_resized" else 3)
        flips = (u[:, 0] < 0.5) & p.hflip
        if p.crop == "random_resized":
            out = self._resized_crop(images, self._boxes(u[:, 1:], *images.shape[-2:]))
        elif p.crop == "pad" and p.crop_padding:
            offsets = np.floor(u[:, 1:3] * (2 * p.crop_padding + 1)).astype(np.int64)
            out = self._shift_crop(images, p.crop_padding, offsets)
        else:
            out = images.clone()
        if flips.any():  # row k of [out; flipped out] is k or k + N: one block copy, no masked select
            choice = torch.from_numpy(np.arange(len(out)) + len(out) * flips)
            out = torch.cat([out, out.flip(-1)]).index_select(0, choice)
        if self.policy is not None:
            out = self._apply_policy(out, uniforms([(*key, _POLICY) for key in keys], 1)[:, 0])
        if p.color_jitter.enabled:
            out = self._jitter(out, uniforms([(*key, _JITTER) for key in keys], 3))
        return out

    def _apply_policy(self, images: torch.Tensor, u: np.ndarray) -> torch.Tensor:
        out = torch.empty_like(images)
        with torch.random.fork_rng(devices=[]):
            for k, seed in enumerate((u * 2.0**53).astype(np.int64).tolist()):
                torch.manual_seed(seed)
                out[k] = self.policy(images[k])
        return out

    def _jitter(self, images: torch.Tensor, u: np.ndarray) -> torch.Tensor:
        """Brightness, then contrast, then saturation, each factor uniform in [max(0, 1 - x), 1 + x], as
        torchvision's ColorJitter defines them; computed in float32, clamped after each step, rounded
        to uint8 once at the end. One sample at a time, so a sample's result never depends on its batch."""
        jitter = self.params.color_jitter
        spans = np.array([jitter.brightness, jitter.contrast, jitter.saturation])
        low = np.maximum(0.0, 1.0 - spans)
        factors = low + u * (1.0 + spans - low)  # (N, 3)
        grey = torch.tensor(_GREY, dtype=torch.float32).view(3, 1, 1)
        out = torch.empty_like(images)
        for k, (bright, contrast, saturation) in enumerate(factors.tolist()):
            x = images[k].to(torch.float32)
            if jitter.brightness:
                x = (x * bright).clamp_(0, 255)
            if jitter.contrast:
                mean = (x * grey).sum(0).mean()
                x = (x * contrast + mean * (1 - contrast)).clamp_(0, 255)
            if jitter.saturation:
                luma = (x * grey).sum(0, keepdim=True)
                x = (x * saturation + luma * (1 - saturation)).clamp_(0, 255)
            out[k] = x.round_().to(torch.uint8)
        return out

    @staticmethod
    def _shift_crop(images: torch.Tensor, pad: int, offsets: np.ndarray) -> torch.Tensor:
        """Reflect-pad by `pad` (mirroring without repeating the edge), crop back at (top, left)."""
        height, width = images.shape[-2:]
        if pad >= min(height, width):
            raise ValueError(f"augment.crop_padding {pad} must be smaller than the image side {min(height, width)}")
        padded = F.pad(images, (pad, pad, pad, pad), mode="reflect").numpy()
        windows = sliding_window_view(padded, (height, width), axis=(2, 3))  # (N, 3, 2p+1, 2p+1, H, W)
        return torch.from_numpy(np.ascontiguousarray(windows[np.arange(len(images)), :, offsets[:, 0], offsets[:, 1]]))

    def _boxes(self, u: np.ndarray, height: int, width: int) -> np.ndarray:
        """(N, 4) integer boxes (top, left, h, w) as torchvision's RandomResizedCrop draws them."""
        (s0, s1), (r0, r1) = self.params.scale, self.params.ratio
        u = u.reshape(len(u), _ATTEMPTS, 4)
        area = height * width * (s0 + u[..., 0] * (s1 - s0))
        aspect = np.exp(math.log(r0) + u[..., 1] * (math.log(r1) - math.log(r0)))
        w, h = np.rint(np.sqrt(area * aspect)), np.rint(np.sqrt(area / aspect))
        fits = (w >= 1) & (w <= width) & (h >= 1) & (h <= height)
        # Fallback when no attempt fits: the largest centre crop with the ratio clamped into range.
        clamped = min(max(width / height, r0), r1)
        fw, fh = (width, round(width / clamped))
        if fh > height:
            fw, fh = round(height * clamped), height
        first = fits.argmax(axis=1)
        rows = np.arange(len(u))
        ok = fits[rows, first]
        w = np.where(ok, w[rows, first], fw).astype(np.int64)
        h = np.where(ok, h[rows, first], fh).astype(np.int64)
        top = np.where(ok, np.floor(u[rows, first, 2] * (height - h + 1)), (height - h) // 2).astype(np.int64)
        left = np.where(ok, np.floor(u[rows, first, 3] * (width - w + 1)), (width - w) // 2).astype(np.int64)
        return np.stack([top, left, h, w], axis=1)

    @staticmethod
    def _resized_crop(images: torch.Tensor, boxes: np.ndarray) -> torch.Tensor:
        """Each sample's box resized back to (H, W): uint8 bilinear, one sample per call (the
        kernel's result for a sample must not depend on which other samples share its batch)."""
        height, width = images.shape[-2:]
        out = torch.empty_like(images)
        for k, (top, left, h, w) in enumerate(boxes.tolist()):
            crop = images[k : k + 1, :, top : top + h, left : left + w]
            out[k] = F.interpolate(crop, size=(height, width), mode="bilinear", antialias=True, align_corners=False)[0]
        return out


def _policy(params: AugmentParams) -> torch.nn.Module | None:
    if params.policy == "none":
        return None
    from torchvision.transforms import v2

    if params.policy == "rand_augment":
        return v2.RandAugment(num_ops=params.policy_ops, magnitude=params.policy_magnitude)
    return v2.TrivialAugmentWide()
