"""Stage export: model.pt + shards -> model.onnx (+ INT8 ONNX, TorchScript), each proven equal to PyTorch.

Every format is scored on the whole test split and gated by params.yaml (ONNX through
tasks.release.inference, the serving path, with the spec read back from the file's own metadata). Files
are built beside their final paths and moved into place only when every gate passes. Parity goes to
export.json (byte-stable); latency goes to a timings file of its own. Each ONNX file carries its drift
reference (tasks/release/drift_reference.py: its own predictions on the test split), and export.json a copy of the
served file's, so the server can tell when traffic no longer looks like the test set. Every format outputs the
model's logits divided by model.pt's temperature (tasks/training/temperature.py), so their softmax is calibrated,
and is proven equal to the same division in PyTorch.
"""

from __future__ import annotations

import json
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch

from tasks.core.blocks import block_rows
from tasks.core.cli import stage_main
from tasks.core.errors import StageError
from tasks.core.io import atomic_dir, atomic_path, sha256_file, write_json
from tasks.core.params import DriftParams, ExportParams, Params, derive_seed, section_hash
from tasks.core.provenance import stage_code_sha256
from tasks.images.imaging import PreprocessSpec
from tasks.images.shards import MANIFEST, ShardSplit
from tasks.release.calibration import Calibration
from tasks.release.drift_reference import REFERENCE_KEY, build_reference, reference_json
from tasks.release.inference import OnnxModel, median_latency_ms, softmax
from tasks.release.onnx_metadata import TEMPERATURE_KEY, write_metadata
from tasks.release.parity import Check, enforce, int8_checks, int8_report, parity, parity_checks
from tasks.release.quantize import calibration_sample, quantize_int8
from tasks.training.models import for_export, load_model_file, normalize, split_logits
from tasks.training.serialize import INPUT_NAME, export_onnx, export_torchscript, load_torchscript, torch_threads
from tasks.training.tempered import temperature_of, tempered

log = logging.getLogger(__name__)

INT8_FILE, TORCHSCRIPT_FILE = "model.int8.onnx", "model.torchscript.pt"


@dataclass(frozen=True)
class ExportResult:
    onnx_path: Path
    agreement: float
    max_abs_diff: float
    report: dict[str, Any]
    timings: dict[str, Any]


def measure_timings(runtimes: dict[str, Any], test: ShardSplit, spec: PreprocessSpec, params: ExportParams,
                    threads: int) -> dict[str, Any]:  # fmt: skip
    """Latency (ms, median) of each runtime at each batch size, all measured side by side in this run, on the
    first test images (repeated when the split has fewer)."""
    latency: dict[str, dict[str, float]] = {}
    for batch in params.timing.batch_sizes:
        x = normalize(torch.from_numpy(test.take(np.arange(batch) % len(test))), spec)
        runners = {name: (lambda fn=fn, x=x: fn(x)) for name, fn in runtimes.items()}
        with torch.inference_mode():
            latency[f"batch_{batch}"] = median_latency_ms(runners, params.timing.repeats)
    speedup = {b: {n: round(row["onnx_fp32"] / ms, 3) for n, ms in row.items()} for b, row in latency.items()}
    return {
        "note": "wall-clock, differs run to run; not a DVC output (see dvc.yaml)",
        "latency_ms_median": latency,
        "speedup_vs_onnx_fp32": speedup,
        "threads": threads,
        "cpu_count": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2),  # other processes' load skews every number here
        "repeats": params.timing.repeats,
        "image_size": spec.image_size,
        "versions": {"torch": torch.__version__, "onnxruntime": ort.__version__, "python": platform.python_version()},
    }


def run(
    params: ExportParams,
    *,
    seed: int,
    model_path: Path,
    shard_dir: Path,
    onnx_path: Path,
    exports_dir: Path,
    report_path: Path,
    timings_path: Path,
    drift: DriftParams | None = None,
) -> ExportResult:
    model, spec, payload = load_model_file(model_path)
    temperature = temperature_of(payload)
    # every format, and the PyTorch reference parity compares them to; timm's reparameterisable models fused
    model = tempered(for_export(model), temperature)
    test = ShardSplit.open(shard_dir, "test")
    test.require_classes(spec.class_names, model_path)
    metadata = _metadata(params, spec, payload, model_path, shard_dir)
    labels = test.labels
    if len(test) == 0:
        raise StageError(f"{shard_dir}: the test split is empty; nothing to prove the export against")
    # torch and onnxruntime get the same thread count, so parity scoring and timings compare like for like
    with (
        torch_threads(params.threads) as threads,
        atomic_dir(exports_dir) as staging,
        atomic_path(onnx_path) as tmp_onnx,  # in place only once every gate passed
    ):
        export_onnx(model, spec, tmp_onnx, params.opset)
        reference = split_logits(model, test, spec, params.batch_size)
        calibration = Calibration.of(drift or DriftParams(), seed)
        fp32, fp32_logits, reference_fp32 = _scored_with_reference(tmp_onnx, {**metadata, "format": "onnx"}, test,
                                                                   params, threads, calibration)  # fmt: skip
        onnx.checker.check_model(str(tmp_onnx), full_check=True)
        report: dict[str, Any] = {**parity(reference, fp32_logits), "num_samples": len(test), "opset": params.opset,
                                  "onnx_sha256": fp32.sha256, "temperature": temperature,
                                  "drift_reference": reference_fp32}  # fmt: skip
        checks = parity_checks("onnx", report, params)
        int8_gates: list[Check] = []
        runtimes = {"pytorch_eager": model, "onnx_fp32": lambda x: fp32.forward(x.numpy())}
        if "torchscript" in params.formats:
            scripted, ts = _torchscript(model, spec, staging, metadata, reference, test, params)
            report["torchscript"] = ts
            checks += parity_checks("torchscript", ts, params)
            runtimes["torchscript"] = scripted
        if "onnx_int8" in params.formats:
            sample = calibration_sample(shard_dir, params.int8.calibration_images, derive_seed(seed, "int8"))
            int8, report["onnx_int8"], int8_gates = _int8(tmp_onnx, fp32, staging, metadata, sample, fp32_logits,
                                                          test, labels, params, threads, calibration)  # fmt: skip
            if int8 is not None:
                runtimes["onnx_int8"] = lambda x: int8.forward(x.numpy())
        if temperature != 1.0:
            log.info("every format outputs the logits divided by temperature %g (model.pt's calibration), "
                     "compared with the same division in PyTorch", temperature)  # fmt: skip
        log.info("gates on %d test images:", len(test))
        enforce(checks)
        for check in int8_gates:
            log.info("  %s", check.describe())
        if not all(c.passed for c in int8_gates):
            log.warning("%s refused by its gates and not written; check_regression fails on them", INT8_FILE)
        timings = measure_timings(runtimes, test, spec, params, threads)
        # DVC may later restore export.json from its run cache without rerunning export, leaving
        # this undeclared file from another model: the hashes say which model these numbers are for.
        timings["model"] = {"onnx_sha256": fp32.sha256, "model_sha256": metadata["model_sha256"]}
    write_json(report_path, report)
    write_json(timings_path, timings)
    for batch, row in timings["latency_ms_median"].items():
        log.info("latency %s (ms, median): %s", batch, ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
    return ExportResult(onnx_path, report["agreement"], report["max_abs_diff"], report, timings)


def _metadata(
    params: ExportParams, spec: PreprocessSpec, payload: dict[str, Any], model_path: Path, shard_dir: Path
) -> dict[str, str]:
    """What every exported file carries in its metadata: the preprocessing spec, classes and provenance."""
    return {
        "preprocess_spec": spec.model_dump_json(),
        "class_names": json.dumps(list(spec.class_names)),
        "arch": str(payload["arch"]),
        "model_sha256": sha256_file(model_path),
        "data_manifest_sha256": sha256_file(shard_dir / MANIFEST),
        "export_params_sha256": section_hash(params),
        "code_sha256": stage_code_sha256("export"),  # what this process loaded, as train's identity counts it
        TEMPERATURE_KEY: repr(temperature_of(payload)),
        **{f"provenance.{k}": str(v) for k, v in payload.get("provenance", {}).items()},
    }


def _scored_with_reference(
    path: Path, metadata: dict[str, str], test: ShardSplit, params: ExportParams, threads: int,
    calibration: Calibration,
) -> tuple[OnnxModel, np.ndarray, dict[str, Any]]:  # fmt: skip
    """The ONNX file's metadata, then its logits on the test split, then its drift reference (its own predictions
    there: what /drift compares traffic to) added to the metadata. Rewriting metadata_props leaves the graph as
    it was, so the logits are the final file's. The reference's thresholds are calibrated to serve.drift's
    false-alarm rate at its window sizes. The session over the final bytes, the logits, the reference."""
    write_metadata(path, metadata)
    scored = OnnxModel.load(path, threads=threads)
    logits = scored.logits(test.blocks(block_rows(scored.spec.image_size, params.batch_size)), params.batch_size)
    drift = build_reference(softmax(logits), scored.class_names, sizes=calibration.sizes,
                            false_alarm_rate=calibration.false_alarm_rate, seed=calibration.seed)  # fmt: skip
    write_metadata(path, {**metadata, REFERENCE_KEY: reference_json(drift)})
    return OnnxModel.load(path, threads=threads), logits, drift


def _torchscript(
    model: torch.nn.Module, spec: PreprocessSpec, staging: Path, metadata: dict[str, str], reference: np.ndarray,
    test: ShardSplit, params: ExportParams,
) -> tuple[torch.nn.Module, dict[str, Any]]:  # fmt: skip
    """TorchScript archive in `staging`, scored against PyTorch's logits."""
    export_torchscript(model, spec, staging / TORCHSCRIPT_FILE, {**metadata, "format": "torchscript"})
    scripted, _ = load_torchscript(staging / TORCHSCRIPT_FILE)
    ts = parity(reference, split_logits(scripted, test, spec, params.batch_size))
    return scripted, {**ts, "sha256": sha256_file(staging / TORCHSCRIPT_FILE)}


def _int8(
    fp32_path: Path, fp32: OnnxModel, staging: Path, metadata: dict[str, str], sample: np.ndarray,
    fp32_logits: np.ndarray, test: ShardSplit, labels: np.ndarray, params: ExportParams, threads: int,
    calibration: Calibration,
) -> tuple[OnnxModel | None, dict[str, Any], list[Check]]:  # fmt: skip
    """Static INT8 in `staging`, gated against fp32; the session (None when its gates refused it), report, gates.

    Deferred, not fatal: INT8 fidelity depends on the model (a half-trained one has small margins that
    rounding flips), so a failed INT8 gate is part of the model's verdict at check_regression, beside
    its accuracy vs the baseline. The file is not kept."""
    quantize_int8(fp32_path, staging / INT8_FILE, fp32.normalize(sample), input_name=INPUT_NAME,
                  per_channel=params.int8.per_channel, keep_head_fp32=params.int8.keep_head_fp32)  # fmt: skip
    int8, int8_logits, _ = _scored_with_reference(staging / INT8_FILE, {**metadata, "format": "onnx_int8"}, test,
                                                  params, threads, calibration)  # fmt: skip
    q = int8_report(fp32_logits, int8_logits, labels)
    gates = int8_checks(q, params)
    kept = all(c.passed for c in gates)
    report = {**q, "calibration_images": len(sample), "kept": kept, "gates": [c.to_json() for c in gates],
              **({"sha256": int8.sha256} if kept else {})}  # fmt: skip
    if not kept:
        (staging / INT8_FILE).unlink()
    return (int8 if kept else None), report, gates


def _main(p: Params) -> None:
    run(
        p.export,
        seed=p.seed,
        model_path=p.paths.model,
        shard_dir=p.paths.shards,
        onnx_path=p.paths.onnx,
        exports_dir=p.paths.exports,
        report_path=p.paths.export_report,
        timings_path=p.paths.export_timings,
        drift=p.serve.drift,
    )


def main() -> None:
    stage_main("export", _main)


if __name__ == "__main__":
    main()
