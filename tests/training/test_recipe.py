"""tasks/training/recipe.py: `auto` train params resolved from the size of the train split; explicit values obeyed."""

from __future__ import annotations

import math

import pytest

from tasks.core.params import ParamsError, TrainParams, parse_params
from tasks.training.feature_probe import FeatureProbe
from tasks.training.mirror import MirrorCheck
from tasks.training.optim import warmup_cosine
from tasks.training.recipe import resolve

pytestmark = pytest.mark.fast  # unit-level: make test-fast

# params.yaml's defaults: batch_size, lr, epochs, warmup_epochs are auto (flips forced: their check is below)
DEFAULT = parse_params({"train": {"augment": {"hflip": True}}}).train


def test_the_default_data_gets_the_recipe_that_reached_0_948_there() -> None:
    recipe = resolve(DEFAULT, 8023)  # the default data's train split
    p = recipe.params
    assert (p.batch_size, p.lr, p.epochs) == (64, 0.1, 6)
    assert recipe.steps_per_epoch == 125 and recipe.total_steps == 750
    # The warmup in steps is what the old fixed `warmup_epochs: 0.5` gave (round(0.5 x 125) = 62).
    assert round(p.warmup_epochs * 125) == round(0.5 * 125) == 62
    assert all(choice.auto for choice in recipe.choices if choice.key != "augment.hflip")


def test_a_small_folder_gets_a_smaller_batch_and_enough_steps() -> None:
    recipe = resolve(DEFAULT, 162)
    p = recipe.params
    assert (p.batch_size, recipe.steps_per_epoch, p.epochs, recipe.total_steps) == (16, 10, 100, 1000)
    assert p.lr == pytest.approx(0.025)  # linear scaling: 0.1 x 16 / 64
    assert (
        recipe.summary()
        == "162 training images: batch 16, lr 0.025, 100 epochs x 10 steps = 1000 steps, warmup 8.33 epochs"
    )
    reasons = "\n".join(recipe.reasons())
    assert "batch_size 16 (auto: 64 at most, and at least 8 steps per epoch)" in reasons
    assert "epochs 100 (auto: 100 epochs of 10 steps reach recipe.small_min_steps 1000 (small data" in reasons
    # The warmup is the same share of the run, whatever its length.
    assert p.warmup_epochs / p.epochs == pytest.approx(DEFAULT.recipe.warmup_fraction)


def test_tiny_and_huge_folders() -> None:
    tiny = resolve(DEFAULT, 20)
    assert tiny.params.batch_size == 8 and "recipe.min_batch 8" in tiny.reasons()[0]
    assert tiny.total_steps >= 400 and tiny.steps_per_epoch == 2
    smaller_than_a_batch = resolve(DEFAULT, 5)
    assert smaller_than_a_batch.params.batch_size == 5 and "the whole train split" in smaller_than_a_batch.reasons()[0]
    huge = resolve(DEFAULT, 100_000)
    assert (huge.params.batch_size, huge.params.epochs, huge.total_steps) == (64, 6, 6 * (100_000 // 64))


def test_explicit_values_are_obeyed_as_written() -> None:
    explicit = DEFAULT.model_copy(update={"batch_size": 64, "lr": 0.1, "epochs": 6, "warmup_epochs": 0.5,
                                          "backbone_lr_scale": 0.5, "freeze_epochs": 2,
                                          "ema_decay": 0.99, "imbalance": "none"})  # fmt: skip
    recipe = resolve(explicit, 162)
    assert (recipe.params.batch_size, recipe.params.lr, recipe.params.epochs, recipe.params.warmup_epochs) == (
        64, 0.1, 6, 0.5,
    )  # fmt: skip
    assert not any(choice.auto for choice in recipe.choices)
    assert (recipe.params.backbone_lr_scale, recipe.params.freeze_epochs) == (0.5, 2)
    assert recipe.total_steps == 12  # the 18-step recipe the issue measured, now chosen knowingly
    # One explicit value; the others still follow the data.
    mixed = resolve(DEFAULT.model_copy(update={"batch_size": 32}), 162)
    assert (mixed.params.batch_size, mixed.params.lr, mixed.params.epochs) == (32, 0.05, 200)


def test_processes_and_accumulation_divide_the_auto_batch() -> None:
    p = DEFAULT.model_copy(update={"nproc_per_node": 3})
    recipe = resolve(p, 8023, processes=3)
    assert recipe.params.batch_size == 63 and "multiple of 3" in recipe.reasons()[0]
    assert resolve(DEFAULT.model_copy(update={"accumulation_steps": 4}), 162).params.batch_size == 16


def test_adamw_gets_its_own_base_lr() -> None:
    recipe = resolve(DEFAULT.model_copy(update={"optimizer": "adamw"}), 8023)
    assert recipe.params.lr == pytest.approx(0.001)


def test_the_schedule_of_a_resolved_recipe_warms_up_then_decays_to_zero() -> None:
    recipe = resolve(DEFAULT, 162)
    warmup = round(recipe.params.warmup_epochs * recipe.steps_per_epoch)
    factor = warmup_cosine(recipe.total_steps, warmup)
    assert factor(0) == pytest.approx(1 / warmup) and factor(warmup) == pytest.approx(1.0)
    assert factor(recipe.total_steps - 1) < 1e-3 and math.isfinite(factor(recipe.total_steps))


def test_auto_and_numbers_are_the_only_values(tmp_path: object) -> None:
    assert TrainParams(epochs="auto").epochs == "auto" and TrainParams(epochs=3).epochs == 3
    with pytest.raises(ParamsError, match=r"train.epochs"):
        parse_params({"train": {"epochs": "automatic"}})
    with pytest.raises(ParamsError, match=r"train.recipe: Value error, min_batch \(128\) is larger than max_batch"):
        parse_params({"train": {"recipe": {"min_batch": 128}}})
    with pytest.raises(ParamsError, match=r"batch_size \(30\) must be divisible"):
        parse_params({"train": {"batch_size": 30, "accumulation_steps": 4}})
    parse_params({"train": {"batch_size": "auto", "accumulation_steps": 4}})  # checked once resolved


@pytest.mark.parametrize("start", [{"pretrained": "IMAGENET1K_V1"}, {"init_from": "models/other.pt"}])
def test_starting_from_weights_resolves_to_a_fine_tuning_recipe(start: dict[str, str]) -> None:
    scratch = resolve(DEFAULT, 162)
    tuned = resolve(DEFAULT.model_copy(update=start), 162)
    p, choices = tuned.params, {c.key: c for c in tuned.choices}
    assert (scratch.params.backbone_lr_scale, scratch.params.freeze_epochs) == (1.0, 0)
    assert p.lr == pytest.approx(0.0075) and p.lr == pytest.approx(scratch.params.lr * 0.3)  # 0.03 x 16 / 64
    assert (p.backbone_lr_scale, p.freeze_epochs, p.batch_size, p.epochs) == (0.3, 1, 16, 40)
    key = next(iter(start))
    assert (
        choices["lr"].why
        == f"fine-tuning from train.{key}: recipe.finetune_lr_sgd 0.03 x batch 16 / 64 (linear scaling)"
    )
    assert choices["freeze_epochs"].why.startswith(f"fine-tuning from train.{key}: recipe.finetune_freeze_epochs")
    assert "head alone for 1 epoch(s), backbone lr x 0.3" in tuned.summary()
    frozen = resolve(DEFAULT.model_copy(update={**start, "freeze_backbone": True}), 162).params
    assert frozen.freeze_epochs == 0  # the whole run trains the head alone already
    set_by_hand = resolve(DEFAULT.model_copy(update={**start, "freeze_epochs": 0, "backbone_lr_scale": 1.0}), 162)
    assert (set_by_hand.params.freeze_epochs, set_by_hand.params.backbone_lr_scale) == (0, 1.0)


def test_hflip_auto_takes_the_mirror_checks_decision_and_says_why() -> None:
    auto = parse_params({}).train
    assert auto.augment.hflip == "auto"
    with pytest.raises(ValueError, match="mirror check"):
        resolve(auto, 162)  # never a silent default: the train stage always measures
    letters = MirrorCheck(300, 10, chance=0.1, accuracy=0.78, with_mirrors=0.6, mirrored=0.29, worst_class="b",
                          worst_lost=20, worst_gained=0, worst_p=1e-6, seconds=0.1)  # fmt: skip
    digits = MirrorCheck(300, 10, chance=0.1, accuracy=0.88, with_mirrors=0.87, mirrored=0.36, worst_class="3",
                         worst_lost=17, worst_gained=0, worst_p=7.6e-6, seconds=0.1)  # fmt: skip
    photos = MirrorCheck(300, 10, chance=0.1, accuracy=0.84, with_mirrors=0.86, mirrored=0.6, worst_class="a",
                         worst_lost=4, worst_gained=1, worst_p=0.19, seconds=0.1)  # fmt: skip
    unsure = MirrorCheck(300, 3, chance=0.33, accuracy=0.38, with_mirrors=0.2, mirrored=0.2, worst_class="a",
                         worst_lost=30, worst_gained=0, worst_p=1e-9, seconds=0.1)  # fmt: skip
    for check, flips in ((letters, False), (digits, False), (photos, True), (unsure, True)):
        recipe = resolve(auto, 162, mirror=check)
        assert recipe.params.augment.hflip is flips
        assert any(r.startswith(f"augment.hflip {'on' if flips else 'off'} (auto: ") for r in recipe.reasons())
        assert recipe.to_json()["mirror_check"]["hflip"] is flips
        assert "seconds" not in recipe.to_json()["mirror_check"]  # train_run.json is byte-reproducible: no timing

    def flip_reason(check: MirrorCheck) -> str:
        return next(r for r in resolve(auto, 162, mirror=check).reasons() if r.startswith("augment.hflip"))

    assert "looks like another class (glyphs, digits, text): no flips" in flip_reason(letters)
    assert "the mirrors took 17 of 3's held-out images and gave back 0" in flip_reason(digits)
    assert "a mirror image of another class looks like 3" in flip_reason(digits)
    assert "too close to chance" in flip_reason(unsure)
    forced = resolve(DEFAULT, 162, mirror=letters)  # true in params.yaml: used as written
    assert forced.params.augment.hflip is True and "augment.hflip on (params.yaml: set in params.yaml)" in (
        forced.reasons()
    )


def test_from_weights_the_rates_follow_how_much_the_features_already_know() -> None:
    tuned = DEFAULT.model_copy(update={"init_from": "backbone.pth"})
    r = tuned.recipe
    gentle, strong = r.finetune_lr_sgd * 16 / 64, r.base_lr_sgd * 16 / 64  # batch 16 for 162 images

    def probe(known: float) -> FeatureProbe:
        return FeatureProbe(images=162, chance=0.0, accuracy=known, seconds=0.1)  # known == accuracy here

    near = resolve(tuned, 162, probe=probe(0.95))
    near_scale = r.finetune_backbone_lr_scale
    assert near.params.lr == pytest.approx(gentle) and near.params.backbone_lr_scale == pytest.approx(near_scale)
    assert "near data: the features are kept" in near.reasons()[1]
    far = resolve(tuned, 162, probe=probe(0.2))
    assert far.params.lr == pytest.approx(strong) and far.params.backbone_lr_scale == pytest.approx(1.0)
    assert "far data: the features are relearnt at the from-scratch rate" in far.reasons()[1]
    halfway = (r.finetune_near_known + r.finetune_far_known) / 2
    middle = resolve(tuned, 162, probe=probe(halfway))
    assert middle.params.lr == pytest.approx(math.sqrt(gentle * strong))
    assert middle.params.backbone_lr_scale == pytest.approx(math.sqrt(near_scale))
    assert middle.params.freeze_epochs == near.params.freeze_epochs == far.params.freeze_epochs == 1
    assert middle.to_json()["feature_probe"]["known"] == pytest.approx(halfway)
    assert "seconds" not in middle.to_json()["feature_probe"]
    # Rates written in params.yaml are used as written, whatever the probe says.
    fixed = resolve(tuned.model_copy(update={"lr": 0.003, "backbone_lr_scale": 0.5}), 162, probe=probe(0.2))
    assert (fixed.params.lr, fixed.params.backbone_lr_scale) == (0.003, 0.5)
    # From scratch there is nothing to probe: the rates are the from-scratch ones.
    assert resolve(DEFAULT, 162, probe=probe(0.2)).params.lr == pytest.approx(strong)


def test_a_small_split_from_scratch_trains_longer_and_says_why() -> None:
    small = resolve(DEFAULT, 1200)
    assert small.total_steps >= DEFAULT.recipe.small_min_steps == 1000
    assert (small.params.batch_size, small.params.epochs) == (64, 56)  # 18 steps per epoch
    reason = next(r for r in small.reasons() if r.startswith("epochs "))
    assert reason == ("epochs 56 (auto: 56 epochs of 18 steps reach recipe.small_min_steps 1000 (small data from "
                      "scratch: 1200 training images, fewer than recipe.small_data_images 2000))")  # fmt: skip
    # The default data's split is not small, and from weights the fine-tuning recipe holds: 400 steps each.
    assert resolve(DEFAULT, 8023).total_steps == 750
    tuned = resolve(DEFAULT.model_copy(update={"init_from": "x.pt"}), 1200)
    assert tuned.params.epochs == 23 and "recipe.min_steps 400" in next(r for r in tuned.reasons() if "epochs" in r)
    # The options the bench measured and left off stay off unless set.
    assert small.params.augment.policy == "none" and small.params.label_smoothing == 0.0 and not small.params.ema


def test_a_probe_of_a_few_shot_folder_is_not_trusted_and_the_data_is_taken_as_near() -> None:
    """5 images per class: 5-fold fits on 4 of each, and near data scored 'known 0.10' (bench_finetune.py
    --probe-only), which would have relearnt features the weights already had."""
    tuned = DEFAULT.model_copy(update={"init_from": "x.pt"})
    few = FeatureProbe(images=15, chance=0.33, accuracy=0.4, seconds=0.1, smallest_class=5)
    assert not few.judged
    recipe = resolve(tuned, 15, probe=few)
    near = resolve(tuned, 15, probe=None)
    assert (recipe.params.lr, recipe.params.backbone_lr_scale) == (near.params.lr, near.params.backbone_lr_scale)
    reason = next(r for r in recipe.reasons() if r.startswith("lr "))
    assert "cannot judge 15 training images: the rarest class has 5, fewer than 10" in reason
    assert recipe.to_json()["feature_probe"]["judged"] is False
    judged = FeatureProbe(images=300, chance=0.33, accuracy=0.4, seconds=0.1, smallest_class=100)
    assert resolve(tuned, 300, probe=judged).params.backbone_lr_scale == 1.0  # far: judged and acted on
