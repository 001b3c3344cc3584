"""The serving path (tasks.release.inference) against the training path: same tensors, verified bytes, clear errors.

training path: image file -> preprocess.run -> Arrow shards -> ShardDataset -> models.normalize
serving path:  the same file's bytes -> spec read from the exported ONNX -> load_array -> normalize
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tasks import preprocess
from tasks.core.io import read_json, sha256_file
from tasks.images.image_set import image_set_sha256, split_sha256
from tasks.images.imaging import ImageError, PreprocessSpec
from tasks.images.shards import MANIFEST, ShardSplit
from tasks.release.inference import ModelIntegrityError, ModelMetadataError, OnnxModel
from tasks.release.onnx_metadata import write_metadata
from tasks.release.scoring import score_split
from tasks.training.dataset import ShardDataset
from tasks.training.models import build_model, load_model_file, normalize, predict_logits, save_model_file
from tests.helpers.export import PARAMS, export_model
from tests.helpers.folders import make_imagefolder


def add_awkward_images(root: Path) -> None:
    """Modes and files users really have: grayscale, alpha, palette, 16-bit, EXIF-rotated JPEG."""
    rng = np.random.default_rng(7)
    for c, folder in enumerate(sorted(p for p in root.iterdir() if p.is_dir())):
        pixels = (rng.random((40 + c * 9, 57, 3)) * 255).astype(np.uint8)
        Image.fromarray(pixels).convert("L").save(folder / "gray.png")
        rgba = Image.fromarray(pixels).convert("RGBA")
        rgba.putalpha(Image.fromarray((rng.random((40 + c * 9, 57)) * 255).astype(np.uint8)))
        rgba.save(folder / "alpha.png")
        Image.fromarray(pixels).convert("P", palette=Image.Palette.ADAPTIVE).save(folder / "palette.gif")
        deep = (rng.random((33, 70)) * 65535).astype(np.uint16)
        Image.fromarray(deep).save(folder / "deep16.png")
        exif = Image.Exif()
        exif[0x0112] = 6  # orientation: rotate 90 degrees on display
        Image.fromarray(pixels).save(folder / "rotated.jpg", exif=exif)


def build_project(root: Path, resize: str) -> Path:
    """Awkward images preprocessed with `resize`, an untrained model on them, exported to ONNX."""
    images = make_imagefolder(root / "images", classes=3, per_class=8)
    add_awkward_images(images)
    params = PARAMS.preprocess.model_copy(update={"resize": resize})
    preprocess.run(params, seed=PARAMS.seed, source=images, out_dir=root / "shards")
    spec = PreprocessSpec.model_validate(read_json(root / "shards" / MANIFEST)["spec"])
    torch.manual_seed(0)  # an untrained network is enough to compare paths
    save_model_file(root / "model.pt", build_model("resnet18", 3), arch="resnet18", spec=spec, provenance={})
    timing = PARAMS.export.timing.model_copy(update={"repeats": 1, "batch_sizes": (1,)})
    export_model(root / "shards", root / "model.pt", root, PARAMS.export.model_copy(
        update={"formats": ("onnx",), "timing": timing}))  # fmt: skip
    return root


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_project(tmp_path_factory.mktemp("inference"), "crop")


@pytest.fixture(scope="module")
def served(project: Path) -> OnnxModel:
    return OnnxModel.load(project / "models/model.onnx", expected_sha256=sha256_file(project / "models/model.onnx"))


def test_training_and_serving_paths_give_identical_tensors(project: Path, served: OnnxModel) -> None:
    assert_paths_agree(project, served, "crop")


@pytest.mark.parametrize("resize", ["squash", "pad"])
def test_every_resize_mode_travels_to_serving(resize: str, tmp_path: Path) -> None:
    """preprocess.resize goes into the spec, the spec into the ONNX file, and serving resizes as training did."""
    root = build_project(tmp_path, resize)
    assert_paths_agree(root, OnnxModel.load(root / "models/model.onnx"), resize)


def assert_paths_agree(project: Path, served: OnnxModel, resize: str) -> None:
    manifest = read_json(project / "shards" / MANIFEST)
    assert manifest["spec"]["resize"] == resize and manifest["resize"]["mode"] == resize
    train_spec = PreprocessSpec.model_validate(manifest["spec"])
    assert served.spec == train_spec  # the spec travelled inside the ONNX file
    datasets = {split: ShardDataset(project / "shards", split) for split in ("train", "val", "test")}
    names = set()
    for entry in manifest["files"]:
        trained_on = normalize(datasets[entry["split"]][entry["index"]][0][None], train_spec)
        data = (project / "images" / entry["path"]).read_bytes()
        serving = normalize(torch.from_numpy(served.preprocess(data))[None], served.spec)
        assert torch.equal(trained_on, serving), entry["path"]
        np.testing.assert_array_equal(served.normalize(served.preprocess(data)[None]), serving.numpy())
        names.add(Path(entry["path"]).name)
    assert {"gray.png", "alpha.png", "palette.gif", "deep16.png", "rotated.jpg"} <= names
    assert len(manifest["files"]) == 3 * (8 + 5)


def test_predict_matches_pytorch_on_the_same_file(project: Path, served: OnnxModel) -> None:
    model, spec, _ = load_model_file(project / "model.pt")
    path = next((project / "images" / "class_1").glob("rotated.jpg"))
    top = served.predict(path.read_bytes(), top_k=2)
    expected = predict_logits(model, served.preprocess(path.read_bytes())[None], spec)[0]
    assert len(top) == 2 and top[0].probability >= top[1].probability
    assert top[0].index == int(expected.argmax()) and top[0].label == spec.class_names[top[0].index]
    assert 0 < top[0].probability <= 1
    everything = served.predict(path.read_bytes(), top_k=10)
    assert len(everything) == 3 and sum(p.probability for p in everything) == pytest.approx(1.0)


def test_one_changed_byte_is_refused_before_onnxruntime_reads_the_file(project: Path, tmp_path: Path) -> None:
    original = project / "models/model.onnx"
    recorded = sha256_file(original)
    tampered = tmp_path / "model.onnx"
    data = bytearray(original.read_bytes())
    data[len(data) // 2] ^= 0x01
    tampered.write_bytes(bytes(data))
    with pytest.raises(
        ModelIntegrityError,
        match=rf"{re.escape(str(tampered))}: sha256 [0-9a-f]{{64}} does not match the recorded {recorded}",
    ):
        OnnxModel.load(tampered, expected_sha256=recorded)
    # A truncated file would make onnxruntime itself fail; the hash check comes first.
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(bytes(data[:1000]))
    with pytest.raises(ModelIntegrityError):
        OnnxModel.load(truncated, expected_sha256=recorded)
    with pytest.raises(Exception, match="(?i)protobuf|parse|invalid|fail") as info:
        OnnxModel.load(truncated)
    assert not isinstance(info.value, ModelIntegrityError)


def test_a_model_without_the_spec_is_refused(project: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare.onnx"
    bare.write_bytes((project / "models/model.onnx").read_bytes())
    write_metadata(bare, {"arch": "resnet18"})
    with pytest.raises(
        ModelMetadataError, match=rf"{re.escape(str(bare))}: no 'preprocess_spec' in the model metadata"
    ):
        OnnxModel.load(bare)
    write_metadata(bare, {"preprocess_spec": '{"image_size": "big"}'})
    with pytest.raises(ModelMetadataError, match="not a valid spec"):
        OnnxModel.load(bare)


def test_bad_inputs_get_clear_errors(served: OnnxModel) -> None:
    with pytest.raises(ImageError, match="not_an_image"):
        served.predict(b"this is not an image")
    with pytest.raises(ValueError, match=r"expected uint8 \(N, 3, 32, 32\) images, got uint8 \(1, 3, 64, 64\)"):
        served.logits(np.zeros((1, 3, 64, 64), np.uint8))
    buffer = io.BytesIO()
    Image.new("RGB", (500, 20), (10, 200, 30)).save(buffer, format="PNG")  # any size is resized and cropped
    assert served.preprocess(buffer.getvalue()).shape == (3, 32, 32)


def test_threads_are_configurable(project: Path) -> None:
    one = OnnxModel.load(project / "models/model.onnx", threads=1)
    assert one.session.get_session_options().intra_op_num_threads == 1
    assert OnnxModel.load(project / "models/model.onnx").session.get_session_options().intra_op_num_threads == 0


def test_score_split_reports_metrics_and_the_test_set_identity(project: Path, served: OnnxModel) -> None:
    metrics = score_split(served, project / "shards")
    test = ShardSplit.open(project / "shards", "test")
    logits = served.logits(test.all_images())
    assert metrics["num_samples"] == len(test)
    assert metrics["accuracy"] == pytest.approx(float((logits.argmax(1) == test.labels).mean()), abs=1e-6)
    manifest = read_json(project / "shards" / MANIFEST)
    assert metrics["test_set_sha256"] == manifest["test_set"]["sha256"] == split_sha256(manifest, "test")
    assert split_sha256(manifest, "train") != metrics["test_set_sha256"]
    test_images = [e["sha256"] for e in manifest["files"] if e["split"] == "test"]
    assert image_set_sha256(reversed(test_images)) == metrics["test_set_sha256"]  # a set: the order does not count


def test_serving_normalisation_equals_trainings_bit_for_bit() -> None:
    """release/ normalises in numpy (no torch), training in torch: the same values, to the last bit."""
    from tasks.images.imaging import PreprocessSpec, normalize_array
    from tasks.training.models import normalize

    spec = PreprocessSpec(image_size=16, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), class_names=("a", "b"))
    images = np.random.default_rng(0).integers(0, 256, (8, 3, 16, 16), dtype=np.uint8)
    expected = normalize(torch.from_numpy(images), spec).numpy()
    assert normalize_array(images, spec).dtype == np.float32
    assert np.array_equal(normalize_array(images, spec), expected)
    assert not np.array_equal(normalize_array(images, spec.model_copy(update={"std": (0.2, 0.2, 0.2)})), expected)
