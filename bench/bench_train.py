"""What the training loop costs, side by side in one run on real shards:

- the real loop (`EpochLoop.fit` + `StepRunner`: data loading, hooks, non-finite checks, gradient norm,
  TensorBoard logging, progress bar) in images/s over whole steps, its first step excluded as warm-up and
  the epoch's end (validation, checkpoint) excluded and printed apart (timed from a hook);
- a bare synthetic step of the same model, precision, batch and optimizer on one batch already in
  memory (forward, loss, backward, step: nothing else);
- the bare step again with channels_last memory format;
- the real loop's ratio to the faster bare format (the loop runs in train.memory_format as resolved);
- then the pieces: loader alone, gradient norm, histograms, checkpoint save.
The three are measured in rounds (default 3), each round in another order, and the ratio is each round's
own, then their median: on a shared 2-core machine one format measured alone swung by a quarter between
minutes (203 to 268 img/s), more than the gap being judged, so a ratio of two numbers taken minutes
apart says little. Prints numbers; asserts nothing.

    .venv/bin/python -m bench.bench_train [--shards data/shards] [--steps 20] [--rounds 3]
Needs shards (dvc repro preprocess). Uses params.yaml's train section (arch, batch size, precision).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tasks.core.params import TrainParams, load_params
from tasks.images.imaging import PreprocessSpec
from tasks.images.shards import ShardSplit, load_manifest
from tasks.training.augment import Augment
from tasks.training.checkpoint import Checkpointer
from tasks.training.dataset import ShardDataset
from tasks.training.distributed import World
from tasks.training.hooks import Hooks
from tasks.training.identity import RunIdentity
from tasks.training.loader import StepSampler, make_loader
from tasks.training.loop import EpochLoop, validate
from tasks.training.models import build_model, normalize
from tasks.training.optim import Schedule, build_optimizer
from tasks.training.precision import Precision, resolve_precision
from tasks.training.recipe import resolve
from tasks.training.runtime import seed_everything
from tasks.training.step import StepRunner
from tasks.training.telemetry import Telemetry

CPU = torch.device("cpu")


class StepClock(Hooks):
    """Times steps 2..last-1 from the start of step 2 to the start of the last step: step 1 (allocations, first
    kernels) is warm-up, as for the bare step, and the epoch's end (validation, checkpoint: once per epoch of
    `steps_per_epoch` steps in the stage, not once per bench's 20) stays out; both are printed apart below."""

    def __init__(self, last: int) -> None:
        self.last = last
        self.started: float | None = None
        self.stopped: float | None = None

    def on_step_start(self, step: int) -> None:
        if step == 2:
            self.started = time.perf_counter()
        elif step == self.last:
            self.stopped = time.perf_counter()


def real_loop(p: TrainParams, shards: Path, spec: PreprocessSpec, steps: int, tmp: Path) -> tuple[float, float]:
    """images/s of `steps` whole steps (loading, step, bookkeeping) through the stage's own loop, and the
    validation seconds at the epoch's end."""
    data = ShardDataset(shards, "train", augment=Augment(p.augment), seed=0)
    gen = torch.Generator().manual_seed(0)
    total = steps + 2
    sampler = StepSampler(total * p.batch_size, p.batch_size, World(), gen)  # the first images, `total` batches
    loader = make_loader(data, sampler, num_workers=p.num_workers, pin_memory=False, generator=gen)
    precision = resolve_precision(p.precision, CPU, p.memory_format)
    model = precision.place(build_model(p.arch, len(spec.class_names)))
    optimizer = build_optimizer(model, p)
    runner = StepRunner(
        model=model, ddp=None, optimizer=optimizer, schedule=Schedule(optimizer, p, total),
        precision=precision, params=p, spec=spec, device=CPU, world=World(),
        telemetry=Telemetry(tmp / "tb", enabled=True, histogram_every=p.histogram_every_steps, purge_step=None),
        hooks=(clock := StepClock(last=total)),
    )  # fmt: skip
    loop = EpochLoop(
        runner,
        checkpointer=Checkpointer(tmp / "ckpt", RunIdentity("p" * 64, "d" * 64)),
        generator=gen,
        dynamics_samples=len(data),
    )
    val = ShardSplit.open(shards, "val")
    val_images = val.all_images()[:64]
    spent: list[float] = []

    def timed_validate(m: torch.nn.Module) -> dict:
        tick = time.perf_counter()
        metrics = validate(m, val_images, val.labels[:64], spec, World())
        spent.append(time.perf_counter() - tick)
        return metrics

    loop.fit(loader=loader, sampler=sampler, dataset=data, validate=timed_validate)
    assert clock.started is not None and clock.stopped is not None
    runner.telemetry.close()
    return steps * p.batch_size / (clock.stopped - clock.started), sum(spent)


def bare_steps(p: TrainParams, spec: PreprocessSpec, precision: Precision, steps: int, channels_last: bool) -> float:
    """images/s of the bare step on one synthetic batch: forward, loss, backward, optimizer step."""
    torch.manual_seed(0)
    model = build_model(p.arch, len(spec.class_names)).train()
    images = torch.randint(0, 256, (p.batch_size, 3, spec.image_size, spec.image_size), dtype=torch.uint8)
    labels = torch.randint(0, len(spec.class_names), (p.batch_size,))
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = build_optimizer(model, p)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=p.label_smoothing)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        x = normalize(images, spec)
        x = x.contiguous(memory_format=torch.channels_last) if channels_last else x
        with precision.autocast():
            loss = criterion(model(x).float(), labels)
        loss.backward()
        optimizer.step()

    step()  # warm-up
    tick = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * p.batch_size / (time.perf_counter() - tick)


def pieces(p: TrainParams, spec: PreprocessSpec, shards: Path, steps: int, tmp: Path) -> dict[str, float]:
    data = ShardDataset(shards, "train", augment=Augment(p.augment), seed=0)
    gen = torch.Generator().manual_seed(0)
    loader = make_loader(data, StepSampler(len(data), p.batch_size, World(), gen), num_workers=p.num_workers,
                         pin_memory=False, generator=gen)  # fmt: skip
    tick, count = time.perf_counter(), 0
    for _ in loader:
        count += 1
        if count == steps:
            break
    load_ms = 1000 * (time.perf_counter() - tick) / count
    model = build_model(p.arch, len(spec.class_names))
    model(torch.zeros(2, 3, spec.image_size, spec.image_size)).sum().backward()
    grads = [q.grad for q in model.parameters()]
    tick = time.perf_counter()
    for _ in range(10):
        torch.nn.utils.get_total_norm(grads, foreach=True).item()
    norm_ms = 100 * (time.perf_counter() - tick)
    telemetry = Telemetry(tmp / "hist", enabled=True, histogram_every=1, purge_step=None)
    tick = time.perf_counter()
    telemetry.histograms(1, model)
    hist_s = time.perf_counter() - tick
    telemetry.close()
    optimizer = build_optimizer(model, p)
    ckpt = Checkpointer(tmp / "save", RunIdentity("p" * 64, "d" * 64))
    save_s = []
    for _ in range(3):
        payload = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "schedule": {}, "scaler": None,
                   "stats": {}, "progress": {}, "rng": {}}  # fmt: skip
        tick = time.perf_counter()
        ckpt.save(payload, is_best=False)
        save_s.append(time.perf_counter() - tick)
    return {"load_ms": load_ms, "norm_ms": norm_ms, "hist_s": hist_s, "save_s": statistics.median(save_s),
            "ckpt_mb": ckpt.last.stat().st_size / 1e6}  # fmt: skip


def rotated_round(measure: dict[str, Any], number: int) -> dict[str, float]:
    """One round: every measurement once, the order rotated by the round's number (no one always goes first)."""
    names = list(measure)
    names = names[number % len(names) :] + names[: number % len(names)]
    got: dict[str, float] = {}
    for name in names:
        rate, val_s = measure[name]()
        got[name] = rate
        if name == "loop":
            got["val_s"] = val_s
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    params = load_params()
    shards = args.shards or params.paths.shards
    seed_everything(0, params.train.threads or torch.get_num_threads(), CPU)
    spec = PreprocessSpec.model_validate(load_manifest(shards)["spec"])
    train_images = len(ShardSplit.open(shards, "train").labels)
    flips = params.train.augment.model_copy(update={"hflip": True})  # what the default data's mirror check decides
    p = resolve(params.train.model_copy(update={"augment": flips}), train_images).params  # the stage's batch and lr
    p = p.model_copy(update={"epochs": 1, "warmup_epochs": 0.0})
    precision = resolve_precision(p.precision, CPU, p.memory_format)
    steps = min(args.steps, train_images // p.batch_size - 1)
    print(
        f"shards {shards}: {train_images} train images, batch {p.batch_size}, {p.arch}, {spec.image_size} px, "
        f"{precision.name}, loop in {precision.memory_format}, {torch.get_num_threads()} threads, "
        f"num_workers {p.num_workers}, {steps} steps each, {args.rounds} rounds"
    )
    with tempfile.TemporaryDirectory() as tmp:
        measure = {
            "loop": lambda: real_loop(p, shards, spec, steps, Path(tmp)),
            "contiguous": lambda: (bare_steps(p, spec, precision, steps, channels_last=False), 0.0),
            "channels_last": lambda: (bare_steps(p, spec, precision, steps, channels_last=True), 0.0),
        }
        rounds = [rotated_round(measure, r) for r in range(args.rounds)]
        parts = pieces(p, spec, shards, steps, Path(tmp))
    for r, got in enumerate(rounds, 1):
        faster = max(got["contiguous"], got["channels_last"])
        print(f"round {r}: real loop {got['loop']:7.1f}  bare contiguous {got['contiguous']:7.1f}  bare channels_last "
              f"{got['channels_last']:7.1f} img/s  loop/faster bare {got['loop'] / faster:.3f}x")  # fmt: skip
    loop, bare, last = (statistics.median(g[k] for g in rounds) for k in ("loop", "contiguous", "channels_last"))
    val_s = statistics.median(g["val_s"] for g in rounds)
    ratio = statistics.median(g["loop"] / max(g["contiguous"], g["channels_last"]) for g in rounds)
    cl_ratio = statistics.median(g["channels_last"] / g["contiguous"] for g in rounds)
    print("medians over the rounds:")
    print(f"real loop (data, hooks, checks, logging)             {loop:7.1f} img/s")
    print(f"bare synthetic step, contiguous                      {bare:7.1f} img/s")
    print(f"bare synthetic step, channels_last                   {last:7.1f} img/s  ({cl_ratio:.3f}x contiguous)")
    print(f"real loop / faster bare format (each round's own)    {ratio:.3f}x")
    print(f"  (at each epoch's end, excluded above: validation of 64 images {val_s:.2f} s, checkpoint below)")
    print(f"data loading (loader alone)   {parts['load_ms']:8.1f} ms/batch")
    print(f"gradient norm (in each step)  {parts['norm_ms']:8.2f} ms")
    print(f"histograms (every N steps)    {parts['hist_s']:8.2f} s per call")
    print(f"checkpoint save ({parts['ckpt_mb']:.0f} MB)     {parts['save_s']:8.2f} s per save")
    print("Run it on a quiet machine: two heavy jobs on 2 cores slow each other several-fold.")


if __name__ == "__main__":
    main()
