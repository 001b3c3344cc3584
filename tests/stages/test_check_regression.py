"""check_regression and promote on a real exported model, with planted faults the gate must name.

Faults: head weights shuffled, test labels permuted, the exported model given the wrong
normalisation, one byte of the ONNX file (or of the baseline's) changed, a baseline that is missing, from
before model.onnx was kept, or of other classes or image size. The baseline is re-scored on today's test
split: a grown test split is compared image by image, and the baseline's scores are reused when nothing
they depend on changed.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from tasks import preprocess
from tasks.core.errors import StageError
from tasks.core.io import read_json, sha256_file, write_json
from tasks.core.params import load_params
from tasks.images.image_set import split_sha256
from tasks.images.shards import MANIFEST
from tasks.release import score_cache, tracking
from tasks.release.inference import OnnxModel
from tasks.release.onnx_metadata import write_metadata
from tasks.release.verdict import Verdict
from tests.helpers.export import ONNX_ONLY, PARAMS, check, export_model, promote_to
from tests.helpers.folders import make_imagefolder
from tests.helpers.tracking import finished_project


def failed(verdict: Verdict) -> list[str]:
    return [r.metric for r in verdict.failures]


@pytest.fixture(scope="module")
def shards(export_shards: Path) -> Path:
    return export_shards


@pytest.fixture(scope="module")
def model(export_model_file: Path) -> Path:
    return export_model_file


@pytest.fixture(scope="module")
def project(shards: Path, model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gate-project")
    export_model(shards, model, root, ONNX_ONLY)
    return root


@pytest.fixture(scope="module")
def baseline(project: Path, model: Path, shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This model, scored and promoted."""
    baseline_dir = tmp_path_factory.mktemp("gate-baseline")
    shutil.rmtree(baseline_dir)
    assert check(project, shards, baseline_dir).passed
    promote_to(project, model, shards, baseline_dir)
    return baseline_dir


def test_no_baseline_passes_and_says_so(project: Path, shards: Path, tmp_path: Path) -> None:
    verdict = check(project, shards, tmp_path / "baseline", out=tmp_path)
    assert verdict.passed and not verdict.has_baseline
    report = read_json(tmp_path / "reports/regression.json")
    assert report["has_baseline"] is False and report["rules"] == []
    assert report["model"]["onnx_sha256"] == sha256_file(project / "models/model.onnx")
    assert report["metrics"]["accuracy"] > 0.9  # the model learned the colour-coded classes
    assert "no baseline yet" in (tmp_path / "reports/regression.md").read_text()


def test_promote_records_hashes_and_metrics_then_the_same_model_passes(
    baseline: Path, project: Path, model: Path, shards: Path, tmp_path: Path
) -> None:
    record = read_json(baseline / "model.json")
    assert record["onnx_sha256"] == sha256_file(project / "models/model.onnx") == sha256_file(baseline / "model.onnx")
    assert record["model_sha256"] == sha256_file(model)
    assert record["data_manifest_sha256"] == sha256_file(shards / MANIFEST)
    assert record["test_set_sha256"] == read_json(shards / MANIFEST)["test_set"]["sha256"]
    assert len(record["code_sha256"]) == 64
    assert read_json(baseline / "metrics.json") == read_json(project / "reports/regression.json")["metrics"]
    manifest = read_json(shards / MANIFEST)
    test_files = [e for e in manifest["files"] if e["split"] == "test"]
    assert read_json(baseline / "test_set.json") == {
        "test_set_sha256": manifest["test_set"]["sha256"], "class_names": manifest["class_names"],
        "images": {e["sha256"]: manifest["class_names"][e["label"]] for e in test_files},
    }  # fmt: skip
    verdict = check(project, shards, baseline, out=tmp_path)
    assert verdict.passed and verdict.has_baseline
    assert [r.metric for r in verdict.results] == [
        "accuracy", "macro_f1", "per_class.class_0.recall", "per_class.class_1.recall", "per_class.class_2.recall",
    ]  # fmt: skip
    assert all(r.delta == 0.0 and r.p_value == 1.0 for r in verdict.results)
    assert verdict.baseline_note == f"baseline re-scored on today's test set: {len(test_files)} images, 0 new"
    table = (tmp_path / "reports/regression.md").read_text()
    assert "| accuracy (higher) |" in table and "**verdict: PASS**" in table
    assert "| n | p | test | result |" in table and "both scored on today's test split" in table


def test_shuffled_head_weights_fail_the_gate(baseline: Path, model: Path, shards: Path, tmp_path: Path) -> None:
    """Planted fault: the classifier's rows rotated. Export parity still holds (ONNX equals this bad
    PyTorch model), so it is the regression gate that must catch it."""
    payload = torch.load(model, map_location="cpu", weights_only=True)
    for key in ("fc.weight", "fc.bias"):
        payload["state_dict"][key] = torch.roll(payload["state_dict"][key], shifts=1, dims=0)
    bad_model = tmp_path / "bad.pt"
    torch.save(payload, bad_model)
    result = export_model(shards, bad_model, tmp_path, ONNX_ONLY)
    assert result.agreement == 1.0
    verdict = check(tmp_path, shards, baseline)
    assert not verdict.passed
    # A class of a few test images is too few to detect a 0.05 loss, but losing all of them is no chance.
    assert {"accuracy", "macro_f1", "per_class.class_0.recall"} <= set(failed(verdict))
    accuracy = verdict.failures[0]
    assert accuracy.metric == "accuracy" and accuracy.delta < -0.5 and accuracy.baseline > 0.9
    assert accuracy.test == "McNemar" and accuracy.p_value < 1e-4


def permute_test_labels(shards: Path, out: Path) -> Path:
    """A copy of the shards whose test labels are rotated (as a labelling bug would), checksums updated."""
    shutil.copytree(shards, out)
    manifest = read_json(out / MANIFEST)
    classes = len(manifest["class_names"])
    for entry in manifest["splits"]["test"]["shards"]:
        path = out / entry["file"]
        table = pa.ipc.open_file(pa.BufferReader(path.read_bytes())).read_all()
        labels = (table.column("label").to_numpy() + 1) % classes
        table = table.set_column(1, table.schema.field(1), pa.array(labels.astype(np.int16)))
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        entry["sha256"] = sha256_file(path)
    write_json(out / MANIFEST, manifest)
    return out


def test_permuted_test_labels_are_named_beside_the_baseline_rescored_on_them(
    baseline: Path, project: Path, model: Path, shards: Path, tmp_path: Path
) -> None:
    """The gate compares models on today's labels: rotated test labels hurt both alike, so the verdict is the
    models' (a worse model still fails), and it names the relabelled images and the baseline's fall."""
    permuted = permute_test_labels(shards, tmp_path / "shards")
    variant = variant_of(project, tmp_path / "variant")  # other bytes, same predictions: the baseline is re-scored
    verdict = check(variant, permuted, baseline, out=tmp_path)
    images = read_json(shards / MANIFEST)["test_set"]["count"]
    assert verdict.passed
    assert verdict.baseline_note == (f"baseline re-scored on today's test set: {images} images, 0 new, {images} "
                                     "relabelled since the promotion")  # fmt: skip
    report = read_json(tmp_path / "reports/regression.json")
    assert report["baseline_rescored"]["metrics"]["accuracy"] < 0.5 < read_json(baseline / "metrics.json")["accuracy"]
    assert report["baseline_rescored"]["test_set"] == {"images": images, "new": 0, "no_longer": 0, "relabelled": images}
    assert "images today" in (tmp_path / "reports/regression.md").read_text()


def test_wrong_normalisation_in_the_exported_model_fails_the_gate(
    baseline: Path, project: Path, shards: Path, tmp_path: Path
) -> None:
    """Planted fault: an exporter that wrote the wrong mean/std into the file, and recorded its hash."""
    (tmp_path / "models").mkdir()
    faulty = tmp_path / "models/model.onnx"
    shutil.copyfile(project / "models/model.onnx", faulty)
    meta = OnnxModel.load(faulty).metadata
    spec = OnnxModel.load(faulty).spec
    # The classic slip: pixels scaled to 0..1 but never normalised (mean 0, std 1).
    wrong = spec.model_copy(update={"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)})
    write_metadata(faulty, {**meta, "preprocess_spec": wrong.model_dump_json()})
    write_json(tmp_path / "reports/export.json", {"onnx_sha256": sha256_file(faulty)})
    verdict = check(tmp_path, shards, baseline)
    assert not verdict.passed and "accuracy" in failed(verdict)


def test_one_changed_byte_is_refused_before_scoring(
    project: Path, shards: Path, baseline: Path, tmp_path: Path
) -> None:
    shutil.copytree(project / "models", tmp_path / "models")
    shutil.copytree(project / "reports", tmp_path / "reports")
    (tmp_path / "reports/regression.json").unlink()
    path = tmp_path / "models/model.onnx"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(StageError, match=r"model\.onnx: sha256 .* does not match the recorded"):
        check(tmp_path, shards, baseline)
    assert not (tmp_path / "reports/regression.json").exists()
    with pytest.raises(StageError, match="does not match the recorded"):
        promote_to(tmp_path, tmp_path / "unused.pt", shards, tmp_path / "baseline")
    assert not (tmp_path / "baseline").exists()


def test_a_baseline_tracked_by_dvc_but_not_pulled_is_an_error(project: Path, shards: Path, tmp_path: Path) -> None:
    (tmp_path / "baseline").mkdir()
    (tmp_path / "baseline/metrics.json.dvc").write_text("outs:\n- md5: 0\n  path: metrics.json\n")
    with pytest.raises(StageError, match=r"tracked by DVC .* but missing; run `dvc pull"):
        check(project, shards, tmp_path / "baseline", out=tmp_path)


def test_a_baseline_of_metrics_only_is_compared_on_its_tolerances_and_says_so(
    baseline: Path, project: Path, shards: Path, tmp_path: Path
) -> None:
    """A baseline promoted before model.onnx was kept cannot be re-scored: its recorded metrics are compared
    as before (no paired test), and one of other test images is one `different test set` line."""
    other = tmp_path / "baseline"
    other.mkdir()
    shutil.copyfile(baseline / "metrics.json", other / "metrics.json")
    verdict = check(project, shards, other, out=tmp_path)
    assert verdict.passed and verdict.alpha is None and all(r.test == "" and r.n is None for r in verdict.results)
    assert verdict.baseline_note.startswith(f"{other / 'model.onnx'} absent: compared with the recorded ")
    write_json(other / "metrics.json", {**read_json(baseline / "metrics.json"), "test_set_sha256": "0" * 64})
    verdict = check(project, shards, other, out=tmp_path)
    # Not rule by rule: one line that names both test sets and what to do.
    assert not verdict.passed and verdict.status == "different test set" and verdict.results == ()
    assert "test set sha256 000000000000" in verdict.summary() and '`make promote ACCEPT="<why>"`' in verdict.summary()
    assert read_json(tmp_path / "reports/gate.json") == {
        "verdict": "different test set", "passed": False, "enforced": True, "summary": verdict.summary(),
        "headline": "different test set", "rules": 0, "not_judged": 0,
    }  # fmt: skip


def test_an_unreadable_baseline_is_named(project: Path, shards: Path, tmp_path: Path) -> None:
    (tmp_path / "baseline").mkdir()
    (tmp_path / "baseline/metrics.json").write_text("{not json")
    with pytest.raises(StageError, match=r"baseline/metrics\.json: not valid JSON"):
        check(project, shards, tmp_path / "baseline", out=tmp_path)


def test_promote_refuses_scores_of_another_model(project: Path, model: Path, shards: Path, tmp_path: Path) -> None:
    shutil.copytree(project / "models", tmp_path / "models")
    shutil.copytree(project / "reports", tmp_path / "reports")
    report = read_json(tmp_path / "reports/regression.json")
    report["model"]["onnx_sha256"] = "f" * 64
    (tmp_path / "reports/regression.json").write_text(json.dumps(report))
    with pytest.raises(StageError, match="run `dvc repro` first"):
        promote_to(tmp_path, model, shards, tmp_path / "baseline")
    assert not (tmp_path / "baseline").exists()


def test_a_failed_int8_gate_keeps_no_int8_file_and_fails_the_verdict(
    baseline: Path, model: Path, shards: Path, tmp_path: Path
) -> None:
    """INT8 fidelity is the model's property: export records the failed gate, check_regression fails on it
    (with or without a baseline), and the refused INT8 file is not written."""
    unreachable = ONNX_ONLY.int8.model_copy(update={"min_agreement": 1.5})  # no model can agree 150%
    params = ONNX_ONLY.model_copy(update={"formats": ("onnx", "onnx_int8"), "int8": unreachable})
    result = export_model(shards, model, tmp_path, params)
    int8 = result.report["onnx_int8"]
    assert int8["kept"] is False and "sha256" not in int8
    assert list((tmp_path / "models/exports").iterdir()) == []
    assert [(g["name"], g["passed"]) for g in int8["gates"]] == [
        ("onnx_int8.accuracy_drop", True), ("onnx_int8.agreement", False),
    ]  # fmt: skip
    assert "onnx_int8" not in result.timings["latency_ms_median"]["batch_1"]
    for baseline_dir in (baseline, tmp_path / "no-baseline"):
        verdict = check(tmp_path, shards, baseline_dir)
        assert not verdict.passed and failed(verdict) == ["onnx_int8.agreement"]
        table = (tmp_path / "reports/regression.md").read_text()
        assert "| onnx_int8.agreement |" in table and "| >= 1.5 | export.int8.min_agreement | FAIL |" in table
    gates = read_json(tmp_path / "reports/regression.json")["export_gates"]
    assert [g["name"] for g in gates if not g["passed"]] == ["onnx_int8.agreement"]


def test_a_tampered_gate_record_is_judged_again(project: Path, shards: Path, tmp_path: Path) -> None:
    copy = tmp_path / "project"
    shutil.copytree(project, copy)
    report = read_json(copy / "reports/export.json")
    gate = {"name": "onnx_int8.agreement", "value": 0.5, "op": ">=", "limit": 0.98, "param": "int8.min_agreement"}
    write_json(copy / "reports/export.json", {**report, "onnx_int8": {"gates": [{**gate, "passed": True}]}})
    verdict = check(copy, shards, tmp_path / "no-baseline", out=tmp_path)
    assert failed(verdict) == ["onnx_int8.agreement"]
    write_json(copy / "reports/export.json", {**report, "onnx_int8": {"gates": [{"name": "x"}]}})
    with pytest.raises(StageError, match=r"export\.json: onnx_int8\.gates\.0 is not a gate record"):
        check(copy, shards, tmp_path / "no-baseline", out=tmp_path)


# -- the baseline re-scored on today's test split -----------------------------------------------------------------


def variant_of(project: Path, out: Path) -> Path:
    """The project's exported model with one more metadata entry: other bytes (so check_regression scores the
    baseline rather than reusing this model's scores for it), the same predictions; export.json updated."""
    shutil.copytree(project / "models", out / "models")
    shutil.copytree(project / "reports", out / "reports")
    onnx = out / "models/model.onnx"
    write_metadata(onnx, {**OnnxModel.load(onnx).metadata, "note": "a variant"})
    write_json(
        out / "reports/export.json", {**read_json(out / "reports/export.json"), "onnx_sha256": sha256_file(onnx)}
    )
    return out


def rewritten_baseline(baseline: Path, out: Path, **spec: object) -> Path:
    """A copy of the baseline whose model carries another spec (`spec` fields replaced), promoted with its hash."""
    shutil.copytree(baseline, out)
    onnx = out / "model.onnx"
    loaded = OnnxModel.load(onnx)
    changed = loaded.spec.model_copy(update=spec)
    write_metadata(onnx, {**loaded.metadata, "preprocess_spec": changed.model_dump_json(),
                          "class_names": json.dumps(list(changed.class_names))})  # fmt: skip
    write_json(out / "model.json", {**read_json(out / "model.json"), "onnx_sha256": sha256_file(onnx)})
    return out


def test_a_grown_test_split_is_compared_image_by_image_and_says_how_many_are_new(
    baseline: Path, project: Path, shards: Path, tmp_path: Path
) -> None:
    """Promoted on test set A; images added to the data (splits are by content hash, so some land in test):
    test set B holds A and more. The baseline is re-scored on B, not refused as another test set."""
    images = shutil.copytree(shards.parent / "images", tmp_path / "images")
    extra = make_imagefolder(tmp_path / "extra", classes=3, per_class=12, seed=11)
    for path in sorted(extra.rglob("*.*")):
        shutil.copyfile(path, images / path.parent.name / f"new_{path.name}")
    grown = tmp_path / "shards"
    preprocess.run(PARAMS.preprocess, seed=PARAMS.seed, source=images, out_dir=grown)
    before, after = (set(read_json(s / MANIFEST)["test_set"]["files"]) for s in (shards, grown))
    assert before < after  # B contains A, and more
    variant = variant_of(project, tmp_path / "variant")
    verdict = check(variant, grown, baseline, out=tmp_path)
    note = f"baseline re-scored on today's test set: {len(after)} images, {len(after - before)} new"
    assert verdict.status == "pass" and verdict.passed and verdict.baseline_note == note
    assert all(r.n is not None and r.delta == 0.0 for r in verdict.results)  # the same predictions, image by image
    assert verdict.summary().endswith("; " + note)
    report = read_json(tmp_path / "reports/regression.json")
    assert report["baseline_rescored"]["metrics"]["num_samples"] == len(after) == report["metrics"]["num_samples"]
    assert report["baseline_rescored"]["onnx_sha256"] == sha256_file(baseline / "model.onnx")
    assert report["baseline_rescored"]["test_set"]["new"] == len(after - before)
    assert note in (tmp_path / "reports/regression.md").read_text()
    # An older baseline, promoted before test_set.json was written: the count of new images is unknown.
    older = tmp_path / "older"
    shutil.copytree(baseline, older)
    (older / "test_set.json").unlink()
    verdict = check(variant, grown, older, out=tmp_path)
    assert verdict.passed and verdict.baseline_note.startswith(
        f"baseline re-scored on today's test set: {len(after)} images, new ones unknown ("
    )


def test_a_baseline_of_other_classes_needs_a_recorded_promotion(
    baseline: Path, project: Path, shards: Path, tmp_path: Path
) -> None:
    other = rewritten_baseline(baseline, tmp_path / "baseline", class_names=("class_0", "class_1", "hound"))
    verdict = check(project, shards, other, out=tmp_path)
    assert not verdict.passed and verdict.status == "different test set" and verdict.results == ()
    line = verdict.summary()
    assert "\n" not in line and line.startswith("different test set: the baseline was scored on ")
    assert "The classes differ, so the baseline cannot be re-scored on this test set" in line
    assert line.endswith('promote one of them, saying why (`make promote ACCEPT="<why>"`)')
    assert read_json(tmp_path / "reports/gate.json")["verdict"] == "different test set"


def test_a_baseline_of_another_image_size_needs_a_recorded_promotion(
    baseline: Path, project: Path, shards: Path, tmp_path: Path
) -> None:
    other = rewritten_baseline(baseline, tmp_path / "baseline", image_size=64)
    verdict = check(project, shards, other, out=tmp_path)
    assert verdict.status == "different test set" and not verdict.passed
    assert "the baseline model takes 64x64 images (squash, bilinear), this run's test shards hold 32x32 (squash" in (
        verdict.summary()
    )
    assert '`make promote ACCEPT="<why>"`' in verdict.summary()


def test_the_baseline_scores_are_reused_and_a_changed_baseline_byte_is_refused_every_time(
    baseline: Path, project: Path, shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    variant = variant_of(project, tmp_path / "variant")
    copy = shutil.copytree(baseline, tmp_path / "baseline")
    cache = tmp_path / "cache"
    first = check(variant, shards, copy, out=tmp_path, cache=cache)
    kept = (cache / "baseline_scores.json").read_bytes()
    assert json.loads(kept)["metrics"]["accuracy"] == read_json(baseline / "metrics.json")["accuracy"]

    def no_scoring(*args: object, **kwargs: object) -> None:
        raise AssertionError("scored again: the kept scores should have been reused")

    monkeypatch.setattr(score_cache, "score_images", no_scoring)
    with caplog.at_level(logging.INFO, logger="tasks.release.score_cache"):
        again = check(variant, shards, copy, out=tmp_path, cache=cache)
    assert again == first and (cache / "baseline_scores.json").read_bytes() == kept
    assert f"test scores of the baseline {copy / 'model.onnx'} reused from {cache / 'baseline_scores.json'}" in (
        caplog.text
    )
    monkeypatch.undo()
    # One changed byte in the promoted model: refused in one line naming it, kept scores or not.
    data = bytearray((copy / "model.onnx").read_bytes())
    data[-100] ^= 0x10
    (copy / "model.onnx").write_bytes(bytes(data))
    for kept_scores in (cache, None):
        with pytest.raises(StageError, match=r"baseline/model\.onnx: sha256 .* does not match the recorded") as err:
            check(variant, shards, copy, out=tmp_path, cache=kept_scores)
        assert "\n" not in str(err.value)


def test_promote_refuses_a_verdict_of_another_test_set_than_the_shards(
    baseline: Path, project: Path, model: Path, shards: Path, tmp_path: Path
) -> None:
    shutil.copytree(project / "models", tmp_path / "models")
    shutil.copytree(project / "reports", tmp_path / "reports")
    report = read_json(tmp_path / "reports/regression.json")
    write_json(
        tmp_path / "reports/regression.json", {**report, "metrics": {**report["metrics"], "test_set_sha256": "e" * 64}}
    )
    with pytest.raises(
        StageError, match=r"scored test set sha256 e{64}, but .* now holds [0-9a-f]{64}; run `dvc repro` first"
    ):
        promote_to(tmp_path, model, shards, tmp_path / "baseline")
    assert not (tmp_path / "baseline").exists()


def test_the_test_set_has_one_identity_in_the_manifest_the_verdict_the_baseline_and_mlflow(
    baseline: Path, project: Path, shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user matching MLflow's `data.test_sha256` tag against regression.json's `test_set_sha256` finds it."""
    root = finished_project(tmp_path / "proj")  # params.yaml (tracking on) and the reports the table reads
    (root / "data/shards").mkdir(parents=True)
    shutil.copy2(shards / MANIFEST, root / "data/shards" / MANIFEST)
    check(project, shards, baseline, out=root)  # the gate's reports, as the stage writes them
    monkeypatch.chdir(root)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_id = tracking.mirror(load_params(root / "params.yaml"), root)
    assert run_id
    tag = tracking.client(f"sqlite:///{root / 'mlflow.db'}").get_run(run_id).data.tags["data.test_sha256"]
    manifest = read_json(shards / MANIFEST)
    assert tag == read_json(root / "reports/regression.json")["metrics"]["test_set_sha256"]
    assert tag == manifest["test_set"]["sha256"] == split_sha256(manifest, "test")
    promoted = read_json(baseline / "test_set.json"), read_json(baseline / "model.json")
    assert tag == promoted[0]["test_set_sha256"] == promoted[1]["test_set_sha256"]
