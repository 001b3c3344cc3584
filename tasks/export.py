"""Stage export: model.pt -> single-file ONNX (dynamic batch), proven equal to PyTorch on the test split.

The ONNX file carries the preprocessing spec and provenance in its metadata_props. It is written
beside its final path and renamed into place only after onnx.checker and the parity gate pass.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from tasks.cli import StageError, stage_main
from tasks.imaging import PreprocessSpec
from tasks.io import sha256_file, write_json
from tasks.models import load_model_file, normalize, predict_logits
from tasks.params import ExportParams
from tasks.shards import ShardSplit

log = logging.getLogger(__name__)

INPUT_NAME, OUTPUT_NAME = "input", "logits"


@dataclass(frozen=True)
class ExportResult:
    onnx_path: Path
    agreement: float
    max_abs_diff: float


def export_onnx(model: torch.nn.Module, spec: PreprocessSpec, path: Path, opset: int) -> None:
    """torch.onnx (dynamo) export with a dynamic batch axis, saved as one file (no external data)."""
    example = torch.zeros(2, 3, spec.image_size, spec.image_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model.eval(),
            (example,),
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_shapes={"x": {0: torch.export.Dim("batch")}},
            opset_version=opset,
            dynamo=True,
            verbose=False,
        )
    program.save(str(path), external_data=False)


def add_metadata(path: Path, metadata: dict[str, str]) -> None:
    proto = onnx.load(str(path))
    del proto.metadata_props[:]
    for key, value in sorted(metadata.items()):
        proto.metadata_props.add(key=key, value=value)
    onnx.save(proto, str(path))


def onnx_logits(path: Path, images: np.ndarray, spec: PreprocessSpec, batch_size: int) -> np.ndarray:
    options = ort.SessionOptions()
    options.intra_op_num_threads = os.cpu_count() or 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    outputs = [
        session.run(
            [OUTPUT_NAME], {INPUT_NAME: normalize(torch.from_numpy(images[i : i + batch_size].copy()), spec).numpy()}
        )[0]
        for i in range(0, len(images), batch_size)
    ]
    return np.concatenate(outputs)


def run(params: ExportParams, *, model_path: Path, shard_dir: Path, onnx_path: Path, report_path: Path) -> ExportResult:
    model, spec, payload = load_model_file(model_path)
    tmp = onnx_path.with_name(f".{onnx_path.name}.tmp-{os.getpid()}")
    onnx_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        export_onnx(model, spec, tmp, params.opset)
        add_metadata(
            tmp,
            {
                "preprocess_spec": spec.model_dump_json(),
                "class_names": json.dumps(list(spec.class_names)),
                "arch": payload["arch"],
                "model_sha256": sha256_file(model_path),
                **{f"provenance.{k}": v for k, v in payload["provenance"].items()},
            },
        )
        onnx.checker.check_model(str(tmp), full_check=True)
        test = ShardSplit.open(shard_dir, "test")
        images = test.all_images()
        reference = predict_logits(model, images, spec, params.batch_size)
        exported = onnx_logits(tmp, images, spec, params.batch_size)
        diff = np.abs(reference - exported)
        report = {
            "agreement": round(float((reference.argmax(1) == exported.argmax(1)).mean()), 6),
            "max_abs_diff": float(f"{diff.max():.3e}"),
            "mean_abs_diff": float(f"{diff.mean():.3e}"),
            "num_samples": len(images),
            "opset": params.opset,
            "onnx_sha256": sha256_file(tmp),
        }
        log.info("ONNX vs PyTorch on %d test images: agreement %.4f, max |diff| %.2e, mean |diff| %.2e",
                 len(images), report["agreement"], report["max_abs_diff"], report["mean_abs_diff"])  # fmt: skip
        failures = []
        if report["agreement"] < params.min_agreement:
            failures.append(f"agreement {report['agreement']} < export.min_agreement {params.min_agreement}")
        if report["max_abs_diff"] > params.max_abs_diff:
            failures.append(f"max_abs_diff {report['max_abs_diff']} > export.max_abs_diff {params.max_abs_diff}")
        if failures:
            raise StageError("ONNX export does not match PyTorch: " + "; ".join(failures))
        os.replace(tmp, onnx_path)
    finally:
        tmp.unlink(missing_ok=True)
    write_json(report_path, report)
    return ExportResult(onnx_path, report["agreement"], report["max_abs_diff"])


def main() -> None:
    stage_main(
        "export",
        lambda p: run(
            p.export,
            model_path=p.paths.model,
            shard_dir=p.paths.shards,
            onnx_path=p.paths.onnx,
            report_path=p.paths.reports / "export.json",
        ),
    )


if __name__ == "__main__":
    main()
