"""fp16 autocast + GradScaler on CUDA (marked gpu; skipped without a CUDA device): `pytest -m gpu`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tasks import train
from tasks.core.io import read_json
from tasks.core.params import TrainParams
from tasks.training.distributed import World
from tasks.training.optim import Schedule, build_optimizer
from tasks.training.precision import resolve_precision
from tasks.training.step import StepRunner
from tasks.training.telemetry import Telemetry
from tests.helpers.faults import FaultHooks, plant
from tests.helpers.training import PARAMS, SPEC, Net, batch, make_shards

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda", 0)


def test_fp16_scaler_skips_an_overflow_and_the_schedule_waits() -> None:
    params = TrainParams(epochs=1, batch_size=32, precision="fp16", device="cuda", warmup_epochs=0.5,
                         backbone_lr_scale=1.0, freeze_epochs=0)  # fmt: skip
    model = Net().to(CUDA)
    optimizer = build_optimizer(model, params)
    hooks = FaultHooks({})
    runner = StepRunner(
        model=model, ddp=None, optimizer=optimizer, schedule=Schedule(optimizer, params, 10),
        precision=resolve_precision("fp16", CUDA), params=params, spec=SPEC, device=CUDA, world=World(),
        telemetry=Telemetry(Path(), enabled=False, histogram_every=0, purge_step=None), hooks=hooks,
    )  # fmt: skip
    assert runner.scaler is not None and runner.precision.dtype == torch.float16
    images, labels = batch(32)
    # The scaler starts at 2**16 and may overflow (and back off) on its own first: wait for an applied step.
    number = 0
    for _ in range(20):
        number += 1
        applied = runner.run(images, labels, number).applied
        if applied:
            break
    assert applied
    updates, skipped = runner.schedule.per_step.last_epoch, runner.stats.scaler_skipped
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    scale = runner.scaler.get_scale()
    hooks.pending[("inf-grad", "step", number + 1)] = "fc.weight"
    assert not runner.run(images, labels, number + 1).applied
    assert runner.stats.scaler_skipped == skipped + 1 and runner.stats.nonfinite == []
    assert runner.schedule.per_step.last_epoch == updates  # the schedule did not advance
    assert runner.scaler.get_scale() == scale / 2
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_stage_trains_in_fp16_on_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shards = make_shards(tmp_path / "data")
    plant(monkeypatch, "inf-grad@step:2:fc.weight")
    params = PARAMS.train.model_copy(update={"device": "cuda", "precision": "fp16"})
    train.run(params, seed=PARAMS.seed, shard_dir=shards, model_path=tmp_path / "model.pt",
              history_path=tmp_path / "history.json", plot_path=tmp_path / "history.png",
              runs_dir=tmp_path / "runs", provenance={})  # fmt: skip
    meta = read_json(tmp_path / "train_run.json")
    assert meta["device"] == "cuda" and meta["precision"] == "fp16"
    assert meta["scaler_skipped_steps"] >= 1 and meta["nonfinite_steps"] == []
    assert meta["optimizer_updates"] == meta["steps"] - meta["scaler_skipped_steps"]
    state = torch.load(tmp_path / "model.pt", weights_only=True)["state_dict"]
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
