"""Latency of PyTorch eager vs ONNX fp32 vs ONNX INT8 (per-tensor and per-channel), side by side.

    .venv/bin/python bench/export_latency.py                       # untrained resnet18, 64x64, 10 classes
    .venv/bin/python bench/export_latency.py --model models/model.pt --shards data/shards --threads 1 2

Prints the median latency (ms) of each runtime per batch size and thread count, measured
interleaved in one process, and each one's speed relative to ONNX fp32. With --shards the INT8
models are calibrated on training images, otherwise on random pixels (latency does not depend on it).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.export import export_onnx, write_metadata  # noqa: E402
from tasks.images.imaging import PreprocessSpec  # noqa: E402
from tasks.release.inference import OnnxModel, median_latency_ms  # noqa: E402
from tasks.release.quantize import calibration_sample, quantize_int8  # noqa: E402
from tasks.training.models import build_model, load_model_file, normalize  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a model.pt (default: an untrained resnet18)")
    parser.add_argument("--size", type=int, default=64, help="input size when no --model is given")
    parser.add_argument("--shards", type=Path, help="calibrate INT8 on this shard folder's training split")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()

    if args.model:
        model, spec, _ = load_model_file(args.model)
    else:
        torch.manual_seed(0)
        spec = PreprocessSpec(image_size=args.size, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
                              class_names=tuple(f"c{i}" for i in range(10)))  # fmt: skip
        model = build_model("resnet18", 10).eval()
    size = spec.image_size
    rng = np.random.default_rng(0)
    if args.shards:
        calibration = calibration_sample(args.shards, 256, seed=0)
    else:
        calibration = rng.integers(0, 256, (256, 3, size, size), dtype=np.uint8)
    with tempfile.TemporaryDirectory() as tmp:
        fp32_path = Path(tmp) / "fp32.onnx"
        export_onnx(model, spec, fp32_path, opset=18)
        write_metadata(fp32_path, {"preprocess_spec": spec.model_dump_json()})
        normalised = OnnxModel.load(fp32_path).normalize(calibration)
        paths = {"onnx_fp32": fp32_path}
        for per_channel in (False, True):
            name = "onnx_int8_per_channel" if per_channel else "onnx_int8"
            paths[name] = Path(tmp) / f"{name}.onnx"
            quantize_int8(fp32_path, paths[name], normalised, input_name="input", per_channel=per_channel)
            write_metadata(paths[name], {"preprocess_spec": spec.model_dump_json()})
        print(f"resnet-style model {type(model).__name__}, input {size}x{size}, repeats {args.repeats}, "
              f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
        for threads in args.threads:
            torch.set_num_threads(threads)
            sessions = {name: OnnxModel.load(path, threads=threads) for name, path in paths.items()}
            for batch in args.batch:
                x = normalize(torch.from_numpy(rng.integers(0, 256, (batch, 3, size, size), dtype=np.uint8)), spec)
                runners = {"pytorch_eager": lambda x=x: model(x)}
                runners |= {name: (lambda s=s, x=x: s.forward(x.numpy())) for name, s in sessions.items()}
                with torch.inference_mode():
                    ms = median_latency_ms(runners, args.repeats)
                cells = ", ".join(f"{k} {v:.2f} ms ({ms['onnx_fp32'] / v:.2f}x)" for k, v in ms.items())
                print(f"threads {threads}, batch {batch:>3}: {cells}")


if __name__ == "__main__":
    main()
