"""augment.policy: torchvision's RandAugment and TrivialAugmentWide, seeded per sample like every other augmentation."""

from __future__ import annotations

import pytest
import torch

from tasks.core.params import AugmentParams
from tasks.training.augment import Augment

pytestmark = pytest.mark.fast


def images(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("policy", ["rand_augment", "trivial_augment"])
def test_a_sample_comes_out_the_same_alone_or_in_any_batch(policy: str) -> None:
    augment = Augment(AugmentParams(hflip=False, crop="none", policy=policy))
    batch = images(8)
    keys = [(1, 0, k) for k in range(8)]
    together = augment.batch(batch, keys)
    alone = torch.stack([augment(batch[k], keys[k]) for k in range(8)])
    assert torch.equal(together, alone)
    reversed_ = augment.batch(batch.flip(0), keys[::-1]).flip(0)
    assert torch.equal(together, reversed_)
    # It changes the images, differently for another epoch, and leaves torch's own random stream alone.
    assert not torch.equal(together, batch)
    assert not torch.equal(together, augment.batch(batch, [(1, 1, k) for k in range(8)]))
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    augment.batch(batch, keys)
    assert torch.equal(torch.rand(3), expected)


def test_turning_a_policy_on_leaves_the_crops_and_flips_as_they_were() -> None:
    """The policy draws from a stream of its own: with an identity policy the images are those of none."""
    batch, keys = images(4), [(2, 0, k) for k in range(4)]
    plain = Augment(AugmentParams(hflip=True, policy="none")).batch(batch, keys)
    zero = Augment(AugmentParams(hflip=True, policy="rand_augment", policy_ops=1, policy_magnitude=0))
    zero.policy = torch.nn.Identity()  # the same draws, no image operation
    assert torch.equal(zero.batch(batch, keys), plain)
    assert Augment(AugmentParams(hflip=True)).policy is None  # none is the default
