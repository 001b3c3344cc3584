"""Backbones side by side on this CPU (issue 60, part 4): what each costs to serve and to train, whether its ONNX
and INT8 files agree with it, and (with --accuracy) what it reaches from scratch on the default data.

    .venv/bin/python -m bench.bench_zoo                        # latency, train rate, parity: about 5 min on 2 cores
    .venv/bin/python -m bench.bench_zoo --models resnet18 timm/lcnet_100 --accuracy --seeds 42 43

Each model is built by the project's own function (tasks.training.models.build_model: torchvision's by name,
timm's as timm/<name>, 10 classes, random init), made servable by for_export (timm's reparameterisable models
fused), and exported by the export stage's function (tasks.training.serialize.export_onnx, opset 18). Per model:
- parameters;
- onnxruntime latency, median of `--repeats` calls, at batch 1 and 8, at 64 and 224 px, with the server's
  session settings (tasks.release.inference.session_options at serve.threads, 1 intra-op thread a stream);
- training img/s at 64 and 224 px: forward, loss, backward and an SGD step on one batch of 32, on 2 threads, after
  one warm-up step, in the precision and memory format the train stage resolves here (bench_storage.train_rate);
- ONNX parity: the largest |logit difference| against PyTorch on 16 random images at 64 px, over the largest logit;
- with --accuracy: params.yaml's train section with train.arch set, on `--shards` (make run's default data), each
  seed (test accuracy, mean), then the export stage's INT8 (static, per-channel as params.yaml's export.int8)
  calibrated on the training split: its agreement with fp32 and its accuracy drop on the test split.
"Published" is ImageNet-1k top-1 of the pretrained weights: torchvision's from its weights' metadata, timm's as
its model cards give them (their own training, not this project's). Asserts nothing; prints one markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_storage import train_rate  # noqa: E402  (a bare train step's img/s)
from tasks import train  # noqa: E402
from tasks.core.params import TIMM_PREFIX, load_params  # noqa: E402
from tasks.images.imaging import PreprocessSpec  # noqa: E402
from tasks.images.shards import ShardSplit  # noqa: E402
from tasks.release.inference import median_latency_ms, session_options  # noqa: E402
from tasks.release.parity import int8_report  # noqa: E402
from tasks.release.quantize import calibration_sample, quantize_int8  # noqa: E402
from tasks.training.models import build_model, for_export, load_model_file, normalize, split_logits  # noqa: E402
from tasks.training.serialize import INPUT_NAME, export_onnx  # noqa: E402

MODELS = ("resnet18", "mobilenet_v3_small", "mobilenet_v3_large", "efficientnet_b0", "regnet_y_400mf",
          "timm/mobilenetv4_conv_small", "timm/lcnet_100", "timm/efficientnet_lite0", "timm/mobileone_s0")  # fmt: skip
TIMM_TOP1 = {"mobilenetv4_conv_small": 73.8, "lcnet_100": 72.1, "efficientnet_lite0": 75.5, "mobileone_s0": 71.4}
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def published_top1(arch: str) -> str:
    if arch.startswith(TIMM_PREFIX):
        top1 = TIMM_TOP1.get(arch.removeprefix(TIMM_PREFIX))
        return f"{top1:.1f}" if top1 else "-"
    import torchvision

    weights = torchvision.models.get_model_weights(arch).DEFAULT
    return f"{weights.meta['_metrics']['ImageNet-1K']['acc@1']:.1f}"


def spec(size: int) -> PreprocessSpec:
    return PreprocessSpec(image_size=size, mean=MEAN, std=STD, class_names=tuple(f"c{i}" for i in range(10)))


def session(path: Path, threads: int):  # noqa: ANN201 (onnxruntime's type)
    import onnxruntime as ort

    return ort.InferenceSession(str(path), session_options(threads), providers=["CPUExecutionProvider"])


def serving_ms(model: torch.nn.Module, size: int, tmp: Path, threads: int, repeats: int) -> dict[int, float]:
    path = tmp / f"m{size}.onnx"
    export_onnx(model, spec(size), path, opset=18)
    run = session(path, threads)
    rng = np.random.default_rng(0)
    inputs = {batch: rng.normal(size=(batch, 3, size, size)).astype(np.float32) for batch in (1, 8)}
    timed = median_latency_ms({str(b): (lambda x=x: run.run(None, {INPUT_NAME: x})) for b, x in inputs.items()},
                              repeats)  # fmt: skip
    return {batch: timed[str(batch)] for batch in inputs}


def parity(model: torch.nn.Module, tmp: Path) -> float:
    """The largest |ONNX - PyTorch| logit difference over the largest |logit| (random init: logits can be 1e8)."""
    path = tmp / "m64.onnx"
    x = torch.randn(16, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(x).numpy()
    got = session(path, 1).run(None, {INPUT_NAME: x.numpy()})[0]
    return float(np.abs(reference - got).max() / max(np.abs(reference).max(), 1e-12))


def accuracy(arch: str, shards: Path, seeds: list[int], tmp: Path) -> tuple[list[float], dict[str, float], float]:
    """Test accuracy per seed from scratch, the first seed's INT8 report on the test split, and mean train s."""
    p = load_params(ROOT / "params.yaml")
    test = ShardSplit.open(shards, "test")
    results, seconds, report = [], [], {}
    for seed in seeds:
        out = tmp / f"{arch.replace('/', '_')}-{seed}"
        began = time.perf_counter()
        run = train.run(p.train.model_copy(update={"arch": arch}), seed=seed, shard_dir=shards,
                        model_path=out / "model.pt", history_path=out / "h.json", plot_path=out / "h.png",
                        runs_dir=out / "runs", provenance={}, parent_dir=out / "parent")  # fmt: skip
        seconds.append(time.perf_counter() - began)
        model, model_spec, _ = load_model_file(run.model_path)
        fp32 = split_logits(model, test, model_spec)
        results.append(float((fp32.argmax(1) == test.labels).mean()))
        if not report:
            onnx, int8 = out / "model.onnx", out / "model.int8.onnx"
            export_onnx(for_export(model), model_spec, onnx, opset=p.export.opset)
            sample = calibration_sample(shards, p.export.int8.calibration_images, seed=seed)
            calibration = normalize(torch.from_numpy(sample), model_spec).numpy()
            quantize_int8(onnx, int8, calibration, input_name=INPUT_NAME, per_channel=p.export.int8.per_channel)
            images = normalize(torch.from_numpy(test.span(0, len(test))), model_spec).numpy()
            quantized = np.concatenate([session(int8, 1).run(None, {INPUT_NAME: images[i : i + 256]})[0]
                                        for i in range(0, len(images), 256)])  # fmt: skip
            report = int8_report(fp32, quantized, np.asarray(test.labels))
    return results, report, statistics.mean(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), help="train.arch names")
    parser.add_argument("--repeats", type=int, default=30, help="onnxruntime calls per latency median")
    parser.add_argument("--accuracy", action="store_true", help="also train each from scratch (minutes each)")
    parser.add_argument("--shards", type=Path, default=ROOT / "data" / "shards", help="for --accuracy")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42], help="for --accuracy")
    args = parser.parse_args()
    threads = load_params(ROOT / "params.yaml").serve.threads
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_zoo_") as name:
        tmp = Path(name)
        for arch in args.models:
            torch.manual_seed(0)
            torch.set_num_threads(2)
            model = for_export(build_model(arch, 10).eval())
            count = sum(p.numel() for p in model.parameters()) / 1e6
            latency = {size: serving_ms(model, size, tmp, threads, args.repeats) for size in (224, 64)}
            rates = {size: train_rate(size, 2, 3, arch)[0] for size in (64, 224)}
            row = {"arch": arch, "params": count, "latency": latency, "parity": parity(model, tmp), "train": rates,
                   "top1": published_top1(arch)}  # fmt: skip
            if args.accuracy:
                row["accuracy"], row["int8"], row["train_s"] = accuracy(arch, args.shards, args.seeds, tmp)
            rows.append(row)
            print(f"  {arch}: done ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    print(f"\n### Backbones on this CPU ({os.cpu_count()} cores), onnxruntime at {threads} thread a call\n")
    extra = " | test acc (seeds) | INT8 agreement / drop | train s" if args.accuracy else ""
    print(f"| model | params M | ms b1 224 / 64 px | ms b8 224 / 64 px | train img/s 64 / 224 px | ONNX rel. diff "
          f"| ImageNet top-1 (published){extra} |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|" + ("---|---:|---:|" if args.accuracy else ""))
    for r in rows:
        cells = [r["arch"], f"{r['params']:.1f}", f"{r['latency'][224][1]:.2f} / {r['latency'][64][1]:.2f}",
                 f"{r['latency'][224][8]:.1f} / {r['latency'][64][8]:.1f}",
                 f"{r['train'][64]:.0f} / {r['train'][224]:.0f}", f"{r['parity']:.1e}", r["top1"]]  # fmt: skip
        if args.accuracy:
            accs = " / ".join(f"{a:.4f}" for a in r["accuracy"])
            int8 = f"{r['int8']['agreement']:.3f} / {r['int8']['accuracy_drop']:+.4f}"
            cells += [f"{accs} (mean {statistics.mean(r['accuracy']):.4f})", int8, f"{r['train_s']:.0f}"]
        print("| " + " | ".join(cells) + " |")
    load = os.getloadavg()
    print(f"\ntorch {torch.__version__}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"{time.perf_counter() - started:.0f} s")  # fmt: skip
    print("command: .venv/bin/python -m bench.bench_zoo " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
