"""The optimizer step on tiny models: accumulation, clipping, freezing, lr groups and schedules, the
GradScaler skip path, NaN/Inf and OOM handling, the sampler's order. Real torch, no mocks."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tasks.core.errors import StageError
from tasks.training.distributed import World
from tasks.training.loader import StepSampler, make_loader
from tasks.training.models import build_model, load_model_file, save_model_file, unwrap
from tasks.training.optim import freeze_backbone, set_train_mode, warmup_cosine
from tasks.training.precision import cpu_has_native_bf16, resolve_precision
from tasks.training.step import NonFiniteError
from tests.helpers.faults import FaultHooks, FaultSpecError
from tests.helpers.training import CPU, SPEC, Net, batch, make_trainer, weights

pytestmark = pytest.mark.fast  # unit-level: make test-fast


def test_accumulation_4x8_gives_the_update_of_one_batch_of_32() -> None:
    torch.manual_seed(0)
    one, four = Net(), None
    four = copy.deepcopy(one)
    images, labels = batch(32)
    t1 = make_trainer(one, momentum=0.9, weight_decay=5e-4)
    t4 = make_trainer(four, momentum=0.9, weight_decay=5e-4, accumulation_steps=4)
    seen: list[int] = []
    four.conv.register_forward_hook(lambda m, x, y: seen.append(len(x[0])))
    for _ in range(2):  # the second step also compares momentum buffers
        a = t1.step(images, labels)
        b = t4.step(images, labels)
        assert a.applied and b.applied and a.count == b.count == 32
        assert b.loss_sum == pytest.approx(a.loss_sum, rel=1e-5)
    assert seen == [8] * 8  # 4 micro-batches of 8 per optimizer step, twice
    for name, value in one.state_dict().items():
        torch.testing.assert_close(four.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert t1.schedule.per_step.last_epoch == t4.schedule.per_step.last_epoch == 2  # one schedule step per update


def test_a_wrong_accumulation_weighting_would_be_caught() -> None:
    """The comparison above is sensitive: a 1.5x larger gradient (what unweighted micro-losses give) differs."""
    torch.manual_seed(0)
    a, b = Net(), None
    b = copy.deepcopy(a)
    images, labels = batch(32)
    make_trainer(a).step(images, labels)
    make_trainer(b, lr=0.15).step(images, labels)
    assert not torch.allclose(a.fc.weight, b.fc.weight, atol=1e-6)


def test_clipping_bounds_the_norm_of_the_update() -> None:
    torch.manual_seed(0)
    clipped, free = Net(), None
    free = copy.deepcopy(clipped)
    before = weights(clipped)
    images, labels = batch(32)
    # lr 1, no momentum or decay: the update is exactly minus the (clipped) gradient.
    out = make_trainer(clipped, lr=1.0, momentum=0.0, weight_decay=0.0, clip_grad_norm=0.01).step(images, labels)
    make_trainer(free, lr=1.0, momentum=0.0, weight_decay=0.0).step(images, labels)

    def update_norm(model: torch.nn.Module) -> float:
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.detach() - before[n])
                                                           for n, p in model.named_parameters()])))  # fmt: skip

    assert out.grad_norm > 0.01  # logged before clipping
    assert update_norm(clipped) == pytest.approx(0.01, rel=1e-3)
    assert update_norm(free) == pytest.approx(out.grad_norm, rel=1e-3)


def test_frozen_backbone_keeps_weights_and_batchnorm_statistics() -> None:
    torch.manual_seed(0)
    model = build_model("resnet18", 3)
    frozen = freeze_backbone(model)
    assert "conv1.weight" in frozen and "fc.weight" not in frozen
    before = weights(model)
    trainer = make_trainer(model, spec=SPEC.model_copy(update={"image_size": 32}), momentum=0.9)
    assert [g["name"] for g in trainer.optimizer.param_groups] == ["head"]
    set_train_mode(model, frozen_backbone=True)
    assert not model.bn1.training and not model.layer4[1].bn2.training and model.training
    for seed in range(2):
        trainer.step(*batch(8, size=32, seed=seed))
    after = model.state_dict()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed == {"fc.weight", "fc.bias"}  # running_mean/var and num_batches_tracked included


def test_a_head_only_step_leaves_the_backbone_and_its_optimizer_state_alone() -> None:
    """train.freeze_epochs: the backbone's gradients are dropped before the update, so neither the update, nor
    weight decay, nor a momentum buffer reaches it; the next step trains every layer."""
    model = Net()
    trainer = make_trainer(model, weight_decay=0.01)
    trainer.runner.head_only = True
    before = weights(model)
    trainer.step(*batch())
    after = weights(model)
    assert torch.equal(before["conv.weight"], after["conv.weight"]) and torch.equal(
        before["conv.bias"], after["conv.bias"]
    )
    assert not torch.equal(before["fc.weight"], after["fc.weight"])
    assert model.conv.weight not in trainer.optimizer.state and model.fc.weight in trainer.optimizer.state
    trainer.runner.head_only = False
    trainer.step(*batch(seed=1))
    assert not torch.equal(after["conv.weight"], weights(model)["conv.weight"])


@pytest.mark.filterwarnings("ignore:Detected call of")
def test_per_group_learning_rates_follow_the_schedule_together() -> None:
    model = build_model("resnet18", 3)
    trainer = make_trainer(model, lr=0.1, backbone_lr_scale=0.1, warmup_epochs=0.5, scheduler="cosine")
    lrs = trainer.schedule.lrs()
    assert lrs["head"] == pytest.approx(0.1 * warmup_cosine(10, 5)(0)) and lrs["backbone"] == pytest.approx(
        lrs["head"] * 0.1
    )
    for _ in range(7):
        trainer.schedule.after_update()
    lrs = trainer.schedule.lrs()
    assert lrs["backbone"] == pytest.approx(0.1 * lrs["head"])
    assert lrs["head"] == pytest.approx(0.1 * warmup_cosine(10, 5)(7))


@pytest.mark.filterwarnings("ignore:Detected call of")
def test_step_and_plateau_schedules() -> None:
    step = make_trainer(Net(), scheduler="step", step_epochs=0.5, gamma=0.5).schedule  # every 5 updates
    seen = []
    for _ in range(11):
        seen.append(step.lrs()["head"])
        step.after_update()
    assert seen == pytest.approx([0.1] * 5 + [0.05] * 5 + [0.025])

    plateau = make_trainer(Net(), scheduler="plateau", warmup_epochs=0.4, gamma=0.5, plateau_patience=1).schedule
    warm = []
    for _ in range(5):
        warm.append(plateau.lrs()["head"])
        plateau.after_update()
    assert warm == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1])  # linear warmup over 4 steps, then flat
    for accuracy in (0.5, 0.6, 0.6, 0.6):  # improves once, then two epochs without improvement
        plateau.after_epoch({"val_accuracy": accuracy, "val_loss": 1.0})
    assert plateau.lrs()["head"] == pytest.approx(0.05)


def test_scaler_skipped_step_leaves_weights_and_schedule_where_they_were() -> None:
    torch.manual_seed(0)
    model = Net()
    trainer = make_trainer(model, precision="fp16", fault="inf-grad@step:2:fc.weight", warmup_epochs=0.5)
    assert trainer.scaler is not None
    images, labels = batch(32)
    assert trainer.step(images, labels).applied
    after_first, lr, scale = weights(model), trainer.schedule.lrs(), trainer.scaler.get_scale()
    out = trainer.step(images, labels)
    assert not out.applied and trainer.stats.scaler_skipped == 1 and trainer.stats.nonfinite == []
    assert all(torch.equal(after_first[k], v) for k, v in model.state_dict().items())
    assert trainer.schedule.per_step.last_epoch == 1 and trainer.schedule.lrs() == lr
    assert trainer.scaler.get_scale() == scale / 2
    assert trainer.step(images, labels).applied and trainer.schedule.per_step.last_epoch == 2


def test_nonfinite_gradient_is_named_skipped_or_aborts() -> None:
    torch.manual_seed(0)
    model = Net()
    trainer = make_trainer(model, fault="nan-grad@step:1:fc.bias", nonfinite="skip", precision="bf16")
    before = weights(model)
    out = trainer.step(*batch(32))
    assert not out.applied and trainer.stats.updates == 0 and trainer.schedule.per_step.last_epoch == 0
    assert trainer.stats.nonfinite == [{"step": 1, "loss_finite": True, "first_parameter": "fc.bias"}]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    aborting = make_trainer(Net(), fault="inf-grad@step:1:conv.bias", nonfinite="abort")
    with pytest.raises(NonFiniteError, match=r"step 1: non-finite gradient; .*conv\.bias.*abort"):
        aborting.step(*batch(32))

    limited = make_trainer(Net(), fault="nan@step:1,nan@step:2", nonfinite="skip", max_nonfinite=1)
    limited.step(*batch(32))
    with pytest.raises(NonFiniteError, match=r"step 2: non-finite loss \(nan\); first parameter .*: conv\.weight"):
        limited.step(*batch(32))


def test_planted_oom_halves_the_micro_batch_and_keeps_the_update() -> None:
    torch.manual_seed(0)
    planted = Net()
    reference = copy.deepcopy(planted)
    images, labels = batch(32)
    trainer = make_trainer(planted, fault="oom@step:1", auto_batch=True)
    out = trainer.step(images, labels)
    assert out.applied and trainer.stats.accumulation == 2
    assert trainer.stats.auto_batch == [{"step": 1, "micro_batch": 16, "accumulation": 2}]
    make_trainer(reference, accumulation_steps=2).step(images, labels)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(planted.state_dict()[name], value, msg=name)

    with pytest.raises(StageError, match=r"out of memory at step 1: micro-batch 32 .* images 3x8x8.*auto_batch: true"):
        make_trainer(Net(), fault="oom@step:1").step(images, labels)


def test_precision_values() -> None:
    # auto: bf16 only where the CPU has it natively (emulated bf16 trains 2.3x slower than fp32)
    assert resolve_precision("auto", CPU).name == ("bf16" if cpu_has_native_bf16() else "fp32")
    assert resolve_precision("fp32", CPU).make_scaler() is None
    assert resolve_precision("bf16", CPU).make_scaler() is None
    assert isinstance(resolve_precision("fp16", CPU).make_scaler(), torch.amp.GradScaler)
    with resolve_precision("bf16", CPU).autocast():
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.bfloat16


def test_one_process_order_matches_a_plain_shuffled_loader() -> None:
    """The recipe's sample order is unchanged: the same batches, epoch after epoch, as DataLoader(shuffle=True)."""
    data = torch.utils.data.TensorDataset(torch.zeros(43, 1), torch.arange(43))
    plain = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True, drop_last=True,
                                        generator=torch.Generator().manual_seed(5))  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    ours = make_loader(data, StepSampler(43, 16, World(), gen), num_workers=0, pin_memory=False, generator=gen)
    for _ in range(3):
        assert [b[1].tolist() for b in plain] == [b[1].tolist() for b in ours]


def test_ranks_split_each_global_batch_and_resume_mid_epoch() -> None:
    def order(rank: int, start: int = 0) -> list[int]:
        sampler = StepSampler(50, 16, World(rank=rank, size=2), torch.Generator().manual_seed(3))
        sampler.start = start
        return list(sampler)

    permutation = torch.randperm(50, generator=torch.Generator().manual_seed(3)).tolist()
    r0, r1 = order(0), order(1)
    assert len(r0) == len(r1) == 24 and not set(r0) & set(r1)
    for k in range(3):  # global batch k = the same 16 samples as one process would take
        assert set(r0[8 * k : 8 * k + 8]) | set(r1[8 * k : 8 * k + 8]) == set(permutation[16 * k : 16 * k + 16])
    assert order(0, start=16) == r0[16:]
    with pytest.raises(ValueError, match="fewer than one global batch"):
        StepSampler(10, 16, World(rank=0, size=2), torch.Generator())


def test_compiled_model_saves_plain_keys(tmp_path: Path) -> None:
    model = build_model("resnet18", 3)
    compiled = torch.compile(model)  # wrapping only: nothing compiles until a forward pass
    assert next(iter(compiled.state_dict())).startswith("_orig_mod.")
    assert unwrap(compiled) is model
    spec = SPEC.model_copy(update={"image_size": 32})
    save_model_file(tmp_path / "m.pt", compiled, arch="resnet18", spec=spec, provenance={})
    loaded, _, payload = load_model_file(tmp_path / "m.pt")
    assert not any(k.startswith("_orig_mod") for k in payload["state_dict"])
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())


def test_fault_spec_is_checked() -> None:
    faults = FaultHooks.parse("nan@step:3, kill@ckpt-write:2, inf-grad@step:1:fc.weight")
    assert faults.take("nan", "step", 3) == "" and faults.take("nan", "step", 3) is None
    assert faults.take("inf-grad", "step", 1) == "fc.weight"
    for bad in ("nan@step", "boom@step:1", "nan-grad@step:1"):
        with pytest.raises(FaultSpecError):
            FaultHooks.parse(bad)
