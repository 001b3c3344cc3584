"""The export stage on tiny shards: every format proven equal to PyTorch, gates that name what failed.

Real torch.onnx, onnx.checker, onnxruntime (fp32 and static INT8) and TorchScript; a model trained
for two epochs on colour-coded classes. The helpers here are reused by the regression-gate tests.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from tasks.core import provenance
from tasks.core.errors import StageError
from tasks.core.io import read_json
from tasks.core.params import ParamsError, parse_params
from tasks.images.shards import MANIFEST, ShardSplit
from tasks.release import parity
from tasks.release.inference import OnnxModel
from tasks.release.onnx_metadata import write_metadata
from tasks.training.identity import run_identity
from tasks.training.models import load_model_file, predict_logits
from tasks.training.serialize import TORCHSCRIPT_METADATA, load_torchscript, stable_archive
from tests.helpers.export import PARAMS, export_model, sha256


@pytest.fixture(scope="module")
def shards(export_shards: Path) -> Path:
    return export_shards


@pytest.fixture(scope="module")
def model(export_model_file: Path) -> Path:
    return export_model_file


@pytest.fixture(scope="module")
def exported(shards: Path, model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("export-out")
    export_model(shards, model, out)
    return out


def test_every_format_is_written_and_proven_equal(exported: Path, shards: Path) -> None:
    files = sorted(p.relative_to(exported).as_posix() for p in exported.rglob("*") if p.is_file())
    assert files == [
        "models/exports/model.int8.onnx",
        "models/exports/model.torchscript.pt",
        "models/model.onnx",
        "reports/export.json",
        "reports/export_timings.json",
    ]  # one ONNX file (no external data), and no temporary leftovers
    report = read_json(exported / "reports/export.json")
    assert report["agreement"] == 1.0 and report["max_abs_diff"] <= PARAMS.export.max_abs_diff
    assert report["onnx_sha256"] == sha256(exported / "models/model.onnx")
    assert report["torchscript"]["agreement"] == 1.0
    assert report["torchscript"]["sha256"] == sha256(exported / "models/exports/model.torchscript.pt")
    int8 = report["onnx_int8"]
    assert int8["sha256"] == sha256(exported / "models/exports/model.int8.onnx")
    assert int8["accuracy_drop"] <= 0.01 and int8["agreement"] >= 0.98
    assert int8["accuracy_drop"] == pytest.approx(int8["fp32_accuracy"] - int8["accuracy"], abs=1e-6)
    assert int8["calibration_images"] == min(
        PARAMS.export.int8.calibration_images, len(ShardSplit.open(shards, "train"))
    )


def test_onnx_is_checked_single_file_with_dynamic_batch(exported: Path, shards: Path) -> None:
    path = exported / "models/model.onnx"
    proto = onnx.load(str(path), load_external_data=False)
    onnx.checker.check_model(proto, full_check=True)
    assert not any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param and [d.dim_value for d in dims[1:]] == [3, 32, 32]
    # No absolute paths (the exporter's stack traces name the venv's files): the same model exported
    # from another checkout has the same bytes.
    for file in (path, exported / "models/exports/model.int8.onnx"):
        data = file.read_bytes()
        assert sys.prefix.encode() not in data and str(Path.cwd()).encode() not in data and b"stack_trace" not in data
    assert any(prop.key == "namespace" for node in proto.graph.node for prop in node.metadata_props)
    served = OnnxModel.load(path)
    images = ShardSplit.open(shards, "test").all_images()[:5]
    together = served.logits(images)
    one_by_one = np.concatenate([served.logits(images[i : i + 1]) for i in range(5)])
    assert together.shape == (5, 3)
    np.testing.assert_allclose(one_by_one, together, atol=1e-5)


def test_metadata_carries_spec_and_provenance_in_every_format(exported: Path, model: Path, shards: Path) -> None:
    _, spec, _ = load_model_file(model)
    meta = OnnxModel.load(exported / "models/model.onnx").metadata
    assert meta["preprocess_spec"] == spec.model_dump_json()
    assert json.loads(meta["class_names"]) == ["class_0", "class_1", "class_2"]
    assert meta["model_sha256"] == sha256(model)
    assert meta["data_manifest_sha256"] == sha256(shards / MANIFEST)
    # (not compared with the version now: tasks/ may be edited while tests run)
    assert len(meta["code_sha256"]) == 64 and int(meta["code_sha256"], 16) >= 0
    assert meta["provenance.params_sha256"] == "p" * 64 and meta["format"] == "onnx"
    common = {k: v for k, v in meta.items() if k != "drift_reference"}
    int8_meta = OnnxModel.load(exported / "models/exports/model.int8.onnx").metadata
    # each ONNX file's drift reference is of its own predictions: INT8's differs from fp32's in top-1 and margin
    assert (
        json.loads(int8_meta.pop("drift_reference"))["num_samples"]
        == json.loads(meta["drift_reference"])["num_samples"]
    )
    assert int8_meta == {**common, "format": "onnx_int8"}
    _, ts_meta = load_torchscript(exported / "models/exports/model.torchscript.pt")
    assert ts_meta == {**common, "format": "torchscript"}  # not served: no drift reference


def test_torchscript_gives_pytorch_logits(exported: Path, model: Path, shards: Path) -> None:
    module, _ = load_torchscript(exported / "models/exports/model.torchscript.pt")
    eager, spec, _ = load_model_file(model)
    images = ShardSplit.open(shards, "test").all_images()
    np.testing.assert_array_equal(predict_logits(module, images, spec), predict_logits(eager, images, spec))


def test_timings_live_in_their_own_file(exported: Path) -> None:
    report = (exported / "reports/export.json").read_text()
    assert "latency" not in report and "_ms" not in report
    timings = read_json(exported / "reports/export_timings.json")
    for batch in ("batch_1", "batch_32"):
        row = timings["latency_ms_median"][batch]
        assert set(row) == {"pytorch_eager", "onnx_fp32", "onnx_int8", "torchscript"}
        assert all(ms > 0 for ms in row.values())
    assert timings["speedup_vs_onnx_fp32"]["batch_1"]["onnx_fp32"] == 1.0
    assert timings["model"]["onnx_sha256"] == read_json(exported / "reports/export.json")["onnx_sha256"]


def test_parity_gate_failure_writes_nothing(shards: Path, model: Path, tmp_path: Path) -> None:
    strict = PARAMS.export.model_copy(update={"max_abs_diff": 1e-12, "formats": ("onnx", "torchscript")})
    with pytest.raises(StageError, match=r"onnx\.max_abs_diff .*must be <= export\.max_abs_diff 1e-12"):
        export_model(shards, model, tmp_path, strict)
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert leftovers == []


def test_wrong_normalisation_in_the_exported_model_fails_the_parity_gate(
    exported: Path, model: Path, shards: Path, tmp_path: Path
) -> None:
    """Planted fault: the exported file carries mean 0 / std 1 instead of the training spec."""
    eager, spec, _ = load_model_file(model)
    faulty = tmp_path / "model.onnx"
    faulty.write_bytes((exported / "models/model.onnx").read_bytes())
    meta = OnnxModel.load(faulty).metadata
    wrong = spec.model_copy(update={"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)})
    write_metadata(faulty, {**meta, "preprocess_spec": wrong.model_dump_json()})
    images = ShardSplit.open(shards, "test").all_images()
    report = parity.parity(predict_logits(eager, images, spec), OnnxModel.load(faulty).logits(images))
    checks = parity.parity_checks("onnx", report, PARAMS.export)
    assert [c.name for c in checks if not c.passed][-1] == "onnx.max_abs_diff"
    with pytest.raises(StageError, match=r"onnx\.max_abs_diff .*: FAIL"):
        parity.enforce(checks)


def test_int8_gates_name_the_failing_rule() -> None:
    fp32 = np.eye(4, dtype=np.float32)[[0, 1, 2, 3, 0, 1, 2, 3, 0, 1]]
    int8 = fp32.copy()
    int8[0] = [0, 1, 0, 0]  # one of ten flipped, and wrong
    report = parity.int8_report(fp32, int8, labels=np.array([0, 1, 2, 3, 0, 1, 2, 3, 0, 1]))
    assert report == {"fp32_accuracy": 1.0, "accuracy": 0.9, "accuracy_drop": 0.1, "agreement": 0.9}
    failed = [c.name for c in parity.int8_checks(report, PARAMS.export) if not c.passed]
    assert failed == ["onnx_int8.accuracy_drop", "onnx_int8.agreement"]


def test_onnx_only_leaves_an_empty_exports_folder(shards: Path, model: Path, tmp_path: Path) -> None:
    params = PARAMS.export.model_copy(update={"formats": ("onnx",), "timing": PARAMS.export.timing.model_copy(
        update={"repeats": 1, "batch_sizes": (2,)})})  # fmt: skip
    result = export_model(shards, model, tmp_path, params)
    assert list((tmp_path / "models/exports").iterdir()) == []
    assert "onnx_int8" not in result.report and "torchscript" not in result.report
    assert set(result.timings["latency_ms_median"]["batch_2"]) == {"pytorch_eager", "onnx_fp32"}


@pytest.mark.parametrize(
    ("formats", "expected"),
    [(["torchscript"], "formats must include onnx"), (["onnx", "onnx"], "lists a format twice"),
     (["onnx", "tflite"], r"export\.formats\.1")],
)  # fmt: skip
def test_bad_formats_are_refused(formats: list[str], expected: str) -> None:
    with pytest.raises(ParamsError, match=expected):
        parse_params({"export": {"formats": formats}})


def test_export_and_train_call_the_same_code_the_same_version() -> None:
    """One code identity (tasks/core/provenance.py): export's metadata and train's run identity hash a stage's
    loaded code the same way, so the same files give the same version, and a changed md5 another."""
    code = provenance.stage_code("export", provenance.project_root())
    assert "tasks/export.py" in code and "tasks/images/imaging.py" in code
    version = provenance.stage_code_sha256("export")
    assert version == provenance.code_sha256(code)
    identity = run_identity(PARAMS.train, seed=0, data_sha256="d", init_sha256=None, device_type="cpu", code=code)
    assert identity.code_sha256 == version
    edited = {**code, "tasks/images/imaging.py": "0" * 32}
    assert provenance.code_sha256(edited) != version


def test_torchscript_archive_is_byte_stable_and_loads(model: Path, tmp_path: Path) -> None:
    """Archives that differ only where separate runs differ (the random serialization id, the debug
    records holding the caller's path) become the same bytes, and the result loads."""
    import io
    import warnings
    import zipfile

    eager, spec, _ = load_model_file(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(eager, torch.zeros(1, 3, 32, 32))
        buffer = io.BytesIO()
        torch.jit.save(traced, buffer, _extra_files={TORCHSCRIPT_METADATA: '{"k": "v"}'})
    other = io.BytesIO()  # the same archive as another run in another folder would write it
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as src, zipfile.ZipFile(other, "w") as dst:
        for info in src.infolist():
            volatile = info.filename.endswith((".debug_pkl", "serialization_id"))
            dst.writestr(info, b"/another/checkout/tasks/export.py" if volatile else src.read(info))
    raw = [buffer.getvalue(), other.getvalue()]
    assert raw[0] != raw[1]
    assert stable_archive(raw[0]) == stable_archive(raw[1])
    path = tmp_path / "m.pt"
    path.write_bytes(stable_archive(raw[0]))
    assert not any(n.endswith((".debug_pkl", "serialization_id")) for n in zipfile.ZipFile(path).namelist())
    module, meta = load_torchscript(path)
    assert meta == {"k": "v"}
    images = np.zeros((2, 3, 32, 32), np.uint8)
    np.testing.assert_array_equal(predict_logits(module, images, spec), predict_logits(eager, images, spec))


def test_calibration_sample_is_seeded_training_images(shards: Path) -> None:
    from tasks.release.quantize import calibration_sample

    train_split = ShardSplit.open(shards, "train")
    first, again = calibration_sample(shards, 10, seed=1), calibration_sample(shards, 10, seed=1)
    assert first.shape == (10, 3, 32, 32) and np.array_equal(first, again)
    assert not np.array_equal(first, calibration_sample(shards, 10, seed=2))
    every = {img.tobytes() for img in train_split.all_images()}
    assert all(img.tobytes() in every for img in first)  # drawn from the training split only
    assert len(calibration_sample(shards, 10_000, seed=1)) == len(train_split)
