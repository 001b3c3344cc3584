"""Memory format chosen like precision (tasks/training/precision.py), and weight decay only where it
belongs (tasks/training/optim.py): the rules, a step under each format, and checkpoints that load under both."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tasks.core.params import TrainParams
from tasks.training import distributed
from tasks.training.checkpoint import Checkpointer
from tasks.training.identity import RunIdentity
from tasks.training.models import build_model
from tasks.training.optim import build_optimizer
from tasks.training.precision import NATIVE_BF16_ENV, Precision, resolve_memory_format, resolve_precision
from tests.helpers.prefect import free_port
from tests.helpers.training import CPU, SPEC, batch, make_trainer, weights

pytestmark = pytest.mark.fast  # unit-level: make test-fast

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize(
    ("requested", "precision", "device", "native", "expected"),
    [
        ("auto", "bf16", CPU, "1", "channels_last"),  # measured faster on an AVX-512 bf16 CPU
        ("auto", "bf16", CPU, "0", "contiguous"),  # emulated bf16: nothing to gain
        ("auto", "fp16", CPU, "0", "contiguous"),  # fp16 on a CPU: the scaler tests' path, not a speed path
        ("auto", "fp16", CUDA, "0", "channels_last"),
        ("auto", "fp32", CUDA, "0", "contiguous"),
        ("channels_last", "fp32", CPU, "0", "channels_last"),  # asked for: taken as asked
        ("contiguous", "bf16", CPU, "1", "contiguous"),
    ],
)
def test_auto_resolves_by_device_and_precision(
    requested: str, precision: str, device: torch.device, native: str, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(NATIVE_BF16_ENV, native)
    assert resolve_memory_format(requested, precision, device) == expected


@pytest.mark.parametrize(("capability", "expected"), [("AVX2", "channels_last"), ("AVX512", "contiguous")])
def test_fp32_on_a_cpu_follows_what_measured_faster_on_its_class(
    capability: str, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert resolve_memory_format("auto", "fp32", CPU) == expected


def test_resolve_precision_carries_the_memory_format(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NATIVE_BF16_ENV, "1")
    assert resolve_precision("auto", CPU, "auto") == Precision("bf16", "cpu", "channels_last")
    monkeypatch.setenv(NATIVE_BF16_ENV, "0")
    here = resolve_memory_format("auto", "fp32", CPU)
    assert resolve_precision("auto", CPU, "auto") == Precision("fp32", "cpu", here)
    assert resolve_precision("auto", CPU, "contiguous").memory_format == "contiguous"


def test_a_channels_last_step_matches_a_contiguous_one_and_saves_contiguous_weights() -> None:
    images, labels = batch(8, size=32, seed=3)
    results = {}
    for memory_format in ("contiguous", "channels_last"):
        torch.manual_seed(0)
        model = build_model("resnet18", len(SPEC.class_names))
        trainer = make_trainer(model, memory_format=memory_format)
        trainer.runner.precision = Precision("fp32", "cpu", memory_format)
        trainer.runner.precision.place(model)
        assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last) is (memory_format != "contiguous")
        out = trainer.runner.run(images, labels, 1)
        results[memory_format] = (out.loss_sum, weights(model))
    (loss_a, wa), (loss_b, wb) = results["contiguous"], results["channels_last"]
    assert loss_a == pytest.approx(loss_b, rel=1e-4)
    assert all(torch.allclose(wa[k].float(), wb[k].float(), atol=1e-4) for k in wa)


@pytest.mark.parametrize(("saved_as", "loaded_as"), [("channels_last", "contiguous"), ("contiguous", "channels_last")])
def test_a_checkpoint_loads_under_either_format(saved_as: str, loaded_as: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = Precision("fp32", "cpu", saved_as).place(build_model("resnet18", 3))
    params = TrainParams.model_validate({"lr": 0.001, "batch_size": 8, "epochs": 1, "backbone_lr_scale": 1.0})
    optimizer = build_optimizer(source, params)
    source(torch.randn(2, 3, 32, 32)).sum().backward()
    optimizer.step()
    ckpt = Checkpointer(tmp_path, RunIdentity("p" * 64, "d" * 64))
    ckpt.save({"model": source.state_dict(), "optimizer": optimizer.state_dict(), "schedule": {}, "scaler": None,
               "stats": {}, "progress": {}, "rng": {}}, is_best=False)  # fmt: skip
    target = Precision("fp32", "cpu", loaded_as).place(build_model("resnet18", 3))
    target.load_state_dict(ckpt.load()["model"])
    build_optimizer(target, params).load_state_dict(ckpt.load()["optimizer"])
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values(),
                                                  strict=True))  # fmt: skip
    x = torch.randn(2, 3, 32, 32)
    assert torch.allclose(source.eval()(x), target.eval()(x), atol=1e-5)


def test_weight_decay_reaches_only_conv_and_linear_weights() -> None:
    model = build_model("resnet18", 3)
    params = TrainParams.model_validate({"lr": 0.1, "batch_size": 8, "epochs": 1, "backbone_lr_scale": 0.5,
                                         "weight_decay": 5e-4, "decay_norm_and_bias": False})  # fmt: skip
    groups = {g["name"]: g for g in build_optimizer(model, params).param_groups}
    assert list(groups) == ["backbone", "backbone_no_decay", "head", "head_no_decay"]
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = {names[id(p)] for g in ("backbone_no_decay", "head_no_decay") for p in groups[g]["params"]}
    assert {"bn1.weight", "bn1.bias", "layer1.0.bn2.weight", "fc.bias"} <= no_decay
    assert all(p.ndim == 1 for g in ("backbone_no_decay", "head_no_decay") for p in groups[g]["params"])
    assert all(p.ndim > 1 for g in ("backbone", "head") for p in groups[g]["params"])
    assert groups["backbone_no_decay"]["weight_decay"] == 0.0 and groups["backbone"]["weight_decay"] == 5e-4
    assert (
        groups["backbone_no_decay"]["lr"] == groups["backbone"]["lr"] == 0.05 and groups["head_no_decay"]["lr"] == 0.1
    )
    every = sum(len(g["params"]) for g in groups.values())
    assert every == len(list(model.parameters()))
    old = build_optimizer(model, params.model_copy(update={"decay_norm_and_bias": True})).param_groups
    assert [g["name"] for g in old] == ["backbone", "head"] and all(g["weight_decay"] == 5e-4 for g in old)


def _ddp_rank(rank: int, port: int, out: str) -> None:
    """Each rank: the DDP gradient of its own half batch, against the mean of both halves' gradients computed
    here without DDP, from the same weights; the model placed and wrapped as tasks/train.py does."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    world = distributed.World(rank=rank, size=2, local_rank=rank, local_size=2)
    place = Precision("fp32", "cpu", "channels_last").place
    torch.manual_seed(0)
    images, labels = torch.randn(2, 4, 3, 32, 32), torch.randint(0, 3, (2, 4))
    reference = place(build_model("resnet18", 3))
    summed = [torch.zeros_like(p) for p in reference.parameters()]
    for half in (0, 1):
        reference.zero_grad()
        torch.nn.functional.cross_entropy(reference(place(images[half])), labels[half]).backward()
        summed = [s + p.grad for s, p in zip(summed, reference.parameters(), strict=True)]
    module = place(build_model("resnet18", 3))
    module.load_state_dict(reference.state_dict())
    wrapped, _ = distributed.wrap(module, world, torch.device("cpu"))
    torch.nn.functional.cross_entropy(wrapped(place(images[rank])), labels[rank]).backward()
    worst = max((p.grad - s / 2).abs().max().item() for p, s in zip(module.parameters(), summed, strict=True))
    Path(out, f"rank{rank}.txt").write_text(f"{worst} {module.conv1.weight.grad.is_contiguous()}")
    dist.destroy_process_group()


def test_ddp_under_channels_last_averages_the_ranks_gradients(tmp_path: Path) -> None:
    mp.spawn(_ddp_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        worst, contiguous = (tmp_path / f"rank{rank}.txt").read_text().split()
        assert float(worst) <= 1e-6, (rank, worst)
        assert contiguous == "False"  # the gradient kept the channels_last layout: the format was really in use
