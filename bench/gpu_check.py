"""`make gpu-check`: the CUDA paths that no CPU test runs, in one script of a few minutes, printed as one table.

    .venv/bin/python bench/gpu_check.py              # on a machine with a CUDA device; skipped (exit 0) without one
    .venv/bin/python bench/gpu_check.py --keep DIR   # keep the shards, runs and ONNX file in DIR

Each row is one check, through the project's own code (tasks.train.run, export_onnx, onnxruntime):

- fp16: a few hundred steps of resnet18 at 64 px in fp16 autocast with GradScaler; every loss finite, the
  scaler's skipped steps counted (train_run.json's nonfinite_steps), images/s from the run's profile.
- bf16: the same steps in bf16 autocast (no scaler), where the device has it.
- resume: the fp16 run interrupted before step 150 (an exception from a training hook), run again without it: it
  resumes from its last checkpoint (step 100) and ends on the same model.pt bytes as the uninterrupted run.
- onnx cuda: the fp16 run's model exported to ONNX, scored by onnxruntime's CUDA execution provider against
  PyTorch on the same device (fp32): max |logit difference| and top-1 agreement. onnxruntime-gpu must be
  installed for that provider (the pinned onnxruntime is the CPU build): without it the row says so and fails.
- auto_batch: a batch of 224 px images that does not fit in a memory cap (torch.cuda's per-process fraction)
  with train.auto_batch on: the run halves its micro-batch until it fits and trains the same global batch.

Exit 1 when any check fails. Numbers are from one run on one device; the table names the device.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEPS_EPOCHS, SMALL, LARGE = 3, 64, 224  # 3 epochs of 100 steps at 64 px; the auto_batch run at 224 px
CAP_BYTES = 3 * 1024**3  # the auto_batch run's memory cap: resnet18 at 224 px and micro-batch 512 does not fit


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def train(params: Any, shards: Path, out: Path, hooks: Any = None) -> dict[str, Any]:
    """One training run of the project's train stage, in process; its train_run.json."""
    from tasks import train as train_stage
    from tasks.core.io import read_json

    train_stage.run(params, seed=0, shard_dir=shards, model_path=out / "model.pt", history_path=out / "history.json",
                    plot_path=out / "history.png", runs_dir=out / "runs", provenance={"params_sha256": "gpu-check"},
                    hooks=hooks)  # fmt: skip
    return read_json(out / "train_run.json")


def precision_row(name: str, params: Any, shards: Path, out: Path) -> tuple[list[Any], dict[str, Any]]:
    from tasks.core.io import read_json

    started = time.monotonic()
    meta = train(params, shards, out)
    history = [row["train_loss"] for row in _history(out)]
    finite = all(abs(loss) < float("inf") for loss in history)
    ok = meta["precision"] == name and finite and meta["optimizer_updates"] > 0
    profile = out / "runs" / "train" / meta["run"] / "profile.json"
    speed = read_json(profile).get("images_per_second", "-") if profile.is_file() else "-"
    detail = (f"{meta['steps']} steps, {meta['optimizer_updates']} updates, {len(meta['nonfinite_steps'])} skipped "
              f"by the scaler, {speed} img/s, final train loss {history[-1]:.4f}")  # fmt: skip
    return [name, ok, detail, time.monotonic() - started], meta


def _history(out: Path) -> list[dict[str, Any]]:
    from tasks.core.io import read_json

    return read_json(out / "history.json")


def resume_row(params: Any, shards: Path, out: Path, whole: Path) -> list[Any]:
    """Interrupted at a step after a checkpoint, run again: the same bytes as the uninterrupted run."""
    from tasks.training.hooks import Hooks

    class StopOnce(Hooks):
        origin = "bench/gpu_check.py: an exception at step 150, once"

        def __init__(self) -> None:
            self.fired = False

        def on_step_start(self, step: int) -> None:
            if step == 150 and not self.fired:
                self.fired = True
                raise KeyboardInterrupt("gpu-check: interrupted at step 150")

    started = time.monotonic()
    try:
        train(params, shards, out, hooks=StopOnce())
        return ["resume", False, "the planted interruption did not stop the run", time.monotonic() - started]
    except KeyboardInterrupt:
        pass
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("tasks")
    level, _ = logger.level, logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        train(params, shards, out)  # no hooks: model.pt then records none, as the uninterrupted run's
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    resumed = next((line for line in lines if "resuming from" in line), None)
    same = resumed is not None and md5(out / "model.pt") == md5(whole / "model.pt")
    detail = f"{resumed or 'did NOT resume'}; model.pt " + (
        "the same bytes as the uninterrupted run" if same else "differs from the uninterrupted run"
    )
    return ["resume", same, detail, time.monotonic() - started]


def onnx_row(model_path: Path, shards: Path, out: Path) -> list[Any]:
    import numpy as np
    import onnxruntime as ort
    import torch

    from tasks.images.shards import ShardSplit
    from tasks.release.parity import parity
    from tasks.training.models import for_export, load_model_file, normalize
    from tasks.training.serialize import INPUT_NAME, export_onnx

    started = time.monotonic()
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return ["onnx cuda", False, f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (providers: "
                f"{', '.join(ort.get_available_providers())}): pip install onnxruntime-gpu in this venv",
                time.monotonic() - started]  # fmt: skip
    model, spec, _ = load_model_file(model_path)
    model = for_export(model)
    export_onnx(model, spec, out / "model.onnx", 18)
    images = torch.from_numpy(np.ascontiguousarray(ShardSplit.open(shards, "test").all_images()[:512]))
    x = normalize(images, spec)
    with torch.no_grad():
        reference = model.cuda().eval()(x.cuda()).float().cpu().numpy()
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CUDAExecutionProvider"])
    used = session.get_providers()[0]
    candidate = session.run(None, {INPUT_NAME: x.numpy()})[0]
    report = parity(reference, candidate)
    ok = used == "CUDAExecutionProvider" and report["max_abs_diff"] < 1e-2 and report["agreement"] >= 0.99
    return ["onnx cuda", ok, f"{used}: max |diff| {report['max_abs_diff']:.2e}, top-1 agreement "
            f"{report['agreement']:.4f} on {len(x)} images", time.monotonic() - started]  # fmt: skip


def auto_batch_row(params: Any, shards: Path, out: Path) -> list[Any]:
    import torch

    started = time.monotonic()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, CAP_BYTES / total))
    try:
        meta = train(params, shards, out)
    except Exception as exc:  # noqa: BLE001 - the row reports it
        return ["auto_batch", False, f"{type(exc).__name__}: {str(exc)[:200]}", time.monotonic() - started]
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    halvings = meta["auto_batch"]
    ok = bool(halvings) and meta["global_batch"] == params.batch_size and meta["optimizer_updates"] == meta["steps"]
    detail = (f"cap {CAP_BYTES / 1024**3:.0f} GiB: micro-batch {params.batch_size} -> {meta['micro_batch']} "
              f"({len(halvings)} halvings, accumulation {halvings[-1]['accumulation'] if halvings else 1}), global "
              f"batch {meta['global_batch']}")  # fmt: skip
    return ["auto_batch", ok, detail, time.monotonic() - started]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="keep the shards, runs and ONNX file here")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print(f"gpu-check skipped: no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda})")
        return 0
    from tasks.core.params import Params
    from tests.helpers.shard_dirs import write_shard_dir

    work = args.keep or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    small, large = work / "shards64", work / "shards224"
    write_shard_dir(small, {"train": 6400, "val": 640, "test": 640}, image_size=SMALL, classes=10)
    write_shard_dir(large, {"train": 2048, "val": 256, "test": 256}, image_size=LARGE, classes=10)
    base = Params().train.model_copy(update={"device": "cuda", "arch": "resnet18", "epochs": STEPS_EPOCHS,
                                             "batch_size": 64, "lr": 0.05, "warmup_epochs": 0.5,
                                             "checkpoint_every_steps": 50})  # fmt: skip
    base = base.model_copy(update={"recipe": base.recipe.model_copy(update={"flip_probe_steps": 0})})
    rows = []
    fp16, _ = precision_row("fp16", base.model_copy(update={"precision": "fp16"}), small, work / "fp16")
    rows.append(fp16)
    if torch.cuda.is_bf16_supported():
        rows.append(precision_row("bf16", base.model_copy(update={"precision": "bf16"}), small, work / "bf16")[0])
    else:
        rows.append(["bf16", True, "not supported by this device: skipped", 0.0])
    rows.append(resume_row(base.model_copy(update={"precision": "fp16"}), small, work / "resume", work / "fp16"))
    rows.append(onnx_row(work / "fp16" / "model.pt", small, work))
    big = base.model_copy(update={"precision": "fp16", "epochs": 1, "batch_size": 512, "auto_batch": True})
    rows.append(auto_batch_row(big, large, work / "auto_batch"))

    name = torch.cuda.get_device_name(0)
    print(f"\ngpu-check on {name} (torch {torch.__version__}, CUDA {torch.version.cuda}); files in {work}\n")
    print("| check | result | detail | s |\n|---|---|---|---|")
    for check, ok, detail, seconds in rows:
        print(f"| {check} | {'pass' if ok else 'FAIL'} | {detail} | {seconds:.0f} |")
    return 0 if all(ok for _, ok, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
