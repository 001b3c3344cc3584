"""Long-tailed train splits (train.imbalance): the loss remedies on hand-computable counts, `auto`'s decision and
its reason, and the balanced sampler (balanced, seeded, the same for any number of workers, resumable)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from tasks import preprocess
from tasks.core.params import TrainParams, parse_params
from tasks.training.augment import Augment
from tasks.training.dataset import ShardDataset
from tasks.training.distributed import World
from tasks.training.imbalance import class_balanced_weights, log_prior
from tasks.training.loader import BalancedSampler, make_loader
from tasks.training.optim import Schedule, build_optimizer
from tasks.training.precision import resolve_precision
from tasks.training.recipe import resolve
from tasks.training.step import StepRunner
from tasks.training.telemetry import Telemetry
from tests.helpers.folders import make_imagefolder
from tests.helpers.training import CPU, PARAMS, SPEC, Net, batch

pytestmark = pytest.mark.fast  # unit-level: make test-fast

FIXED = {"epochs": 1, "batch_size": 4, "lr": 0.1, "warmup_epochs": 0.0, "precision": "fp32",
         "backbone_lr_scale": 1.0, "freeze_epochs": 0}  # fmt: skip


def runner(model: torch.nn.Module, counts: list[int] | None, **update: object) -> StepRunner:
    params = TrainParams.model_validate({**FIXED, **update})
    optimizer = build_optimizer(model, params)
    return StepRunner(
        model=model, ddp=None, optimizer=optimizer, schedule=Schedule(optimizer, params, steps_per_epoch=10),
        precision=resolve_precision("fp32", CPU), params=params, spec=SPEC, device=CPU, world=World(),
        telemetry=Telemetry(Path(), enabled=False, histogram_every=0, purge_step=None), class_counts=counts,
    )  # fmt: skip


def silent() -> Net:
    """A net whose logits are all 0: the loss is then a function of the counts alone."""
    net = Net()
    torch.nn.init.zeros_(net.fc.weight)
    torch.nn.init.zeros_(net.fc.bias)
    return net


def test_class_balanced_weights_are_one_over_the_effective_number_with_mean_one() -> None:
    # beta 0.5: (1 - beta) / (1 - beta^n) = 1, 2/3, 8/15 for 1, 2, 4 images; scaled by 3 / (1 + 2/3 + 8/15) = 15/11
    weights = class_balanced_weights([1, 2, 4], beta=0.5)
    torch.testing.assert_close(weights, torch.tensor([15 / 11, 10 / 11, 8 / 11]))
    assert float(weights.mean()) == pytest.approx(1.0)
    assert torch.allclose(class_balanced_weights([7, 7, 7], beta=0.999), torch.ones(3))  # balanced: plain loss
    torch.testing.assert_close(log_prior([1, 1, 2]), torch.tensor([0.25, 0.25, 0.5]).log())


def test_the_loss_remedies_on_zero_logits() -> None:
    """Zero logits: plain cross-entropy is log 3 for any label; class_balanced weighs it by the label's class;
    logit_adjust scores softmax(log prior), so a label's loss is -log of its class's share."""
    images, _ = batch(4)
    labels = torch.tensor([0, 0, 1, 2])
    plain = runner(silent(), [1, 2, 4]).run(images, labels, 1)
    weighted = runner(silent(), [1, 2, 4], imbalance="class_balanced", recipe={"cb_beta": 0.5}).run(images, labels, 1)
    adjusted = runner(silent(), [1, 2, 4], imbalance="logit_adjust").run(images, labels, 1)
    assert plain.loss_sum / 4 == pytest.approx(math.log(3), rel=1e-5)
    assert weighted.loss_sum / 4 == pytest.approx((15 + 15 + 10 + 8) / 11 / 4 * math.log(3), rel=1e-5)
    assert adjusted.loss_sum / 4 == pytest.approx(-(2 * math.log(1 / 7) + math.log(2 / 7) + math.log(4 / 7)) / 4,
                                                  rel=1e-5)  # fmt: skip
    with pytest.raises(ValueError, match="logit_adjust needs the train split's class counts"):
        runner(silent(), None, imbalance="logit_adjust")


def test_logit_adjustment_moves_training_only() -> None:
    """The adjusted loss pushes a rare class's logit up (its prior's handicap is made up by the model), and the
    model it trains has the plain model's outputs and keys: nothing is added at inference."""
    torch.manual_seed(0)
    plain, adjusted = Net(), None
    adjusted = copy.deepcopy(plain)
    images, labels = batch(32)
    runner(plain, [30, 30, 1], batch_size=32).run(images, labels, 1)
    runner(adjusted, [30, 30, 1], imbalance="logit_adjust", batch_size=32).run(images, labels, 1)
    assert plain.state_dict().keys() == adjusted.state_dict().keys()
    with torch.no_grad():
        rare = (adjusted(images.float()) - plain(images.float()))[:, 2].mean()
    assert rare > 0


def test_a_loss_remedy_keeps_accumulation_exact() -> None:
    torch.manual_seed(0)
    one = Net()
    four = copy.deepcopy(one)
    images, labels = batch(32)
    for remedy in ("class_balanced", "logit_adjust"):
        a = runner(one, [40, 10, 2], imbalance=remedy, batch_size=32).run(images, labels, 1)
        b = runner(four, [40, 10, 2], imbalance=remedy, batch_size=32, accumulation_steps=4).run(images, labels, 1)
        assert b.loss_sum == pytest.approx(a.loss_sum, rel=1e-5)
        for name, value in one.state_dict().items():
            torch.testing.assert_close(four.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)


DEFAULT = parse_params({"train": {"augment": {"hflip": True}}}).train


def test_auto_applies_the_remedy_at_the_ratio_and_none_below_with_the_reason() -> None:
    long_tail = resolve(DEFAULT, 300, class_counts=[152, 60, 24, 8])
    assert long_tail.params.imbalance == DEFAULT.recipe.imbalance_remedy
    reasons = [r for r in long_tail.reasons() if r.startswith("imbalance ")]
    assert reasons == [f"imbalance {DEFAULT.recipe.imbalance_remedy} (auto: largest/smallest 19.0 >= "
                       f"recipe.imbalance_ratio 4 (152 and 8 training images): {DEFAULT.recipe.imbalance_remedy}, "
                       "the remedy bench_long_tail measured best)"]  # fmt: skip
    assert long_tail.to_json()["choices"]["imbalance"]["value"] == DEFAULT.recipe.imbalance_remedy  # train_run.json
    at_the_ratio = resolve(DEFAULT, 300, class_counts=[40, 10])
    assert at_the_ratio.params.imbalance == DEFAULT.recipe.imbalance_remedy
    near = resolve(DEFAULT, 300, class_counts=[39, 10, 25])
    assert near.params.imbalance == "none"
    assert "imbalance none (auto: largest/smallest 3.9 < recipe.imbalance_ratio 4 (39 and 10 training images): " \
           "near enough to balanced)" in near.reasons()  # fmt: skip
    other = DEFAULT.model_copy(update={"recipe": DEFAULT.recipe.model_copy(update={"imbalance_remedy":
                                                                                   "balanced_sampler"})})  # fmt: skip
    assert resolve(other, 300, class_counts=[40, 10]).params.imbalance == "balanced_sampler"
    written = resolve(DEFAULT.model_copy(update={"imbalance": "none"}), 300, class_counts=[152, 8])
    assert (
        written.params.imbalance == "none" and "imbalance none (params.yaml: set in params.yaml)" in written.reasons()
    )


def long_tailed_shards(root: Path) -> Path:
    source = make_imagefolder(root / "images", classes=3, per_class=40)
    for folder, keep in zip(sorted(source.iterdir()), (40, 12, 5), strict=True):
        for extra in sorted(folder.iterdir())[keep:]:
            extra.unlink()
    preprocess.run(PARAMS.preprocess, seed=PARAMS.seed, source=source, out_dir=root / "shards")
    return root / "shards"


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return long_tailed_shards(tmp_path_factory.mktemp("long-tail"))


def test_the_balanced_sampler_draws_each_class_equally_often(shards: Path) -> None:
    dataset = ShardDataset(shards, "train")
    counts = dataset.class_counts
    assert max(counts) / min(counts) >= 5
    sampler = BalancedSampler(dataset.labels, 8, World(), torch.Generator().manual_seed(1))
    assert len(list(sampler)) == sampler.steps_per_epoch * 8  # whole global batches, as the plain sampler
    for _ in range(3):  # each epoch: one class-balanced order over the split's length
        order = sampler.order()
        per_class = torch.bincount(torch.as_tensor(dataset.labels)[torch.tensor(order) % len(dataset)], minlength=3)
        assert int(per_class.max() - per_class.min()) <= 1 and int(per_class.sum()) == len(dataset)
    # The rarest class's images recur about evenly, each repeat numbered apart so it is augmented apart.
    rare = [i for i in order if int(dataset.labels[i % len(dataset)]) == counts.index(min(counts))]
    seen = torch.bincount(torch.tensor([i % len(dataset) for i in rare]))
    assert int(seen[seen > 0].max() - seen[seen > 0].min()) <= 1 and len(set(rare)) == len(rare)


def test_the_balanced_sampler_is_seeded_and_resumes_and_splits_like_the_plain_one(shards: Path) -> None:
    labels = ShardDataset(shards, "train").labels

    def order(rank: int = 0, size: int = 1, start: int = 0) -> list[int]:
        sampler = BalancedSampler(labels, 8, World(rank=rank, size=size), torch.Generator().manual_seed(3))
        sampler.start = start
        return list(sampler)

    assert order() == order() and order() != list(BalancedSampler(labels, 8, World(), torch.Generator()))
    assert order(start=16) == order()[16:]  # what the loop sets from a checkpoint's position
    r0, r1 = order(0, 2), order(1, 2)
    assert sorted(r0 + r1) == sorted(order())


def test_balanced_batches_are_the_same_for_any_number_of_workers(shards: Path) -> None:
    augment = Augment(PARAMS.train.augment.model_copy(update={"hflip": True}))

    def batches(workers: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        dataset = ShardDataset(shards, "train", augment=augment, seed=5)
        generator = torch.Generator().manual_seed(7)
        sampler = BalancedSampler(dataset.labels, 8, World(), generator)
        loader = make_loader(dataset, sampler, num_workers=workers, pin_memory=False, generator=generator)
        out = []
        for epoch in range(2):
            dataset.set_epoch(epoch)
            out += list(loader)
        return out

    zero, two = batches(0), batches(2)
    assert len(zero) == len(two) > 0
    for (a, la, ia), (b, lb, ib) in zip(zero, two, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb) and torch.equal(ia, ib)
    epoch_one = zero[: len(zero) // 2]
    indices = torch.cat([i for _, _, i in epoch_one]).tolist()
    assert max(indices) < len(ShardDataset(shards, "train"))  # the loop counts images, not repeats
    images = torch.cat([x for x, _, _ in epoch_one])
    repeated = [(a, b) for a in range(len(indices)) for b in range(a + 1, len(indices)) if indices[a] == indices[b]]
    assert repeated  # rare images were drawn more than once in the epoch, each time augmented anew
    assert sum(not torch.equal(images[a], images[b]) for a, b in repeated) > len(repeated) / 2
