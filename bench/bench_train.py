"""Train-loop costs on real shards, side by side in one run: data loading vs compute per step, the
checkpoint write, and the per-step extras (gradient norm, histograms). Prints numbers; asserts nothing.

    .venv/bin/python -m bench.bench_train [--shards data/shards] [--steps 20]
Needs shards (dvc repro preprocess). Uses params.yaml's train section (arch, batch size, precision).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tasks.augment import Augment
from tasks.checkpoint import Checkpointer, RunIdentity, capture_rng
from tasks.dataset import ShardDataset
from tasks.distributed import World
from tasks.faults import Faults
from tasks.imaging import PreprocessSpec
from tasks.loader import StepSampler, make_loader
from tasks.models import build_model
from tasks.monitor import Monitor
from tasks.optim import Schedule, build_optimizer
from tasks.params import load_params
from tasks.precision import resolve_precision
from tasks.recipe import resolve
from tasks.runstate import Progress, seed_everything
from tasks.shards import load_manifest
from tasks.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    p = load_params()
    shards = args.shards or p.paths.shards
    cpu = torch.device("cpu")
    seed_everything(0, p.train.threads or torch.get_num_threads(), cpu)
    spec = PreprocessSpec.model_validate(load_manifest(shards)["spec"])
    data = ShardDataset(shards, "train", augment=Augment(p.train.augment), seed=0)
    p = p.model_copy(update={"train": resolve(p.train, len(data)).params})  # the batch and lr the stage would use
    gen = torch.Generator().manual_seed(0)
    sampler = StepSampler(len(data), p.train.batch_size, World(), gen)
    loader = make_loader(data, sampler, num_workers=p.train.num_workers, pin_memory=False, generator=gen)
    batches = []
    tick, cpu0 = time.perf_counter(), time.process_time()
    for images, labels, _ in loader:
        batches.append((images, labels))
        if len(batches) == args.steps:
            break
    load_ms = 1000 * (time.perf_counter() - tick) / len(batches)
    load_cpu_ms = 1000 * (time.process_time() - cpu0) / len(batches)  # this process only: num_workers 0

    model = build_model(p.train.arch, len(spec.class_names))
    optimizer = build_optimizer(model, p.train)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(
            model=model, ddp=None, optimizer=optimizer, schedule=Schedule(optimizer, p.train, len(batches)),
            precision=resolve_precision(p.train.precision, cpu), params=p.train, spec=spec, device=cpu,
            world=World(), monitor=Monitor(Path(tmp), enabled=True, histogram_every=1, purge_step=None),
            faults=Faults(),
        )  # fmt: skip
        model.train()
        progress = Progress()
        trainer.step(*batches[0], progress)  # warm-up
        step_ms, step_cpu_ms, norm_ms, hist_s = [], [], [], []
        grads = [q for q in model.parameters()]
        for images, labels in batches[1:]:
            tick, cpu0 = time.perf_counter(), time.process_time()
            trainer.step(images, labels, progress)
            step_ms.append(1000 * (time.perf_counter() - tick))
            step_cpu_ms.append(1000 * (time.process_time() - cpu0))
            tick = time.perf_counter()
            torch.nn.utils.get_total_norm([q.grad for q in grads], foreach=True).item()
            norm_ms.append(1000 * (time.perf_counter() - tick))
        for _ in range(2):
            tick = time.perf_counter()
            trainer.monitor.histograms(1, model)
            hist_s.append(time.perf_counter() - tick)
        trainer.monitor.close()
        ckpt = Checkpointer(Path(tmp) / "ckpt", RunIdentity("p" * 64, "d" * 64))
        save_s = []
        for _ in range(3):
            payload = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "schedule": {},
                       "scaler": None, "progress": {}, "rng": capture_rng(gen.get_state())}  # fmt: skip
            tick = time.perf_counter()
            ckpt.save(payload, is_best=False)
            save_s.append(time.perf_counter() - tick)
        size_mb = ckpt.last.stat().st_size / 1e6
    step, step_cpu = statistics.median(step_ms), statistics.median(step_cpu_ms)
    threads = torch.get_num_threads()
    mid_ms = statistics.median(norm_ms)
    print(f"shards {shards}: {len(data)} train images, batch {p.train.batch_size}, {p.train.arch}, "
          f"{trainer.precision.name}, {threads} threads, num_workers {p.train.num_workers}")  # fmt: skip
    print(f"data loading (loader alone)   {load_ms:8.1f} ms/batch wall, {load_cpu_ms:.1f} ms CPU")
    print(f"optimizer step (compute)      {step:8.1f} ms/step wall ({p.train.batch_size / step * 1000:.0f} img/s), "
          f"{step_cpu:.1f} ms CPU")  # fmt: skip
    print(f"data wait share if the loader runs in the training process: {load_ms / (load_ms + step):.2%}")
    print(f"gradient norm (in each step)  {mid_ms:8.2f} ms ({mid_ms / step:.2%} of a step)")
    print(f"histograms (every N steps)    {statistics.median(hist_s):8.2f} s per call")
    print(f"checkpoint save ({size_mb:.0f} MB)     {statistics.median(save_s):8.2f} s per save")
    print("CPU time includes OpenMP spin-waits: on a busy machine both wall and CPU figures inflate.")


if __name__ == "__main__":
    main()
