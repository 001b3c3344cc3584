"""The train stage on tiny shards: same weights twice, what the run records, resume and fresh start,
planted NaN and OOM, transfer learning with another class count, and the sanity check."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, PngImagePlugin

from tasks import preprocess, train
from tasks.core.errors import StageError
from tasks.core.io import read_json
from tasks.tools import sanity
from tasks.training.checkpoint import CheckpointError
from tasks.training.epoch_record import read_epoch_line
from tasks.training.models import build_model, load_model_file
from tasks.training.precision import cpu_has_native_bf16
from tasks.training.step import NonFiniteError
from tests.helpers.faults import plant
from tests.helpers.training import PARAMS, make_shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_shards(tmp_path_factory.mktemp("train"))


def train_once(shards: Path, out: Path, **update: object) -> train.TrainResult:
    return train.run(
        PARAMS.train.model_copy(update=update), seed=PARAMS.seed, shard_dir=shards, model_path=out / "model.pt",
        history_path=out / "history.json", plot_path=out / "history.png", runs_dir=out / "runs",
        provenance={"params_sha256": "x"},
    )  # fmt: skip


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def model(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_once(shards, tmp_path_factory.mktemp("model")).model_path


def test_same_params_give_the_same_weights(shards: Path, model: Path, tmp_path: Path) -> None:
    assert md5(train_once(shards, tmp_path / "again").model_path) == md5(model)
    assert md5(train_once(shards, tmp_path / "workers", num_workers=2).model_path) == md5(model)
    assert md5(train_once(shards, tmp_path / "other", lr=0.02).model_path) != md5(model)


def test_history_and_run_record(model: Path) -> None:
    history = read_json(model.parent / "history.json")
    assert [row["epoch"] for row in history] == [1, 2]
    assert (model.parent / "history.png").read_bytes()[:4] == b"\x89PNG"
    meta = read_json(model.parent / "train_run.json")
    steps = meta["steps_per_epoch"]
    assert (
        meta["precision"] == ("bf16" if cpu_has_native_bf16() else "fp32")
        and meta["processes"] == 1
        and meta["steps"] == 2 * steps
    )
    assert meta["optimizer_updates"] == 2 * steps and meta["nonfinite_steps"] == [] and meta["auto_batch"] == []
    for epoch in meta["coverage"]:  # every sample of the used global batches exactly once per epoch
        assert epoch["seen_once"] == steps * 16 and epoch["seen_more_than_once"] == 0
    run_dir = model.parent / "runs" / "checkpoints" / meta["run"]
    assert sorted(p.name for p in run_dir.iterdir()) == ["best.pt", "identity.json", "last.pt"]
    assert (model.parent / "runs" / "train" / meta["run"] / "profile.json").is_file()  # wall-clock, unversioned


def test_each_epoch_is_one_record_a_watcher_reads(
    shards: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A sweep's pruner reads train's epoch records from its output (flows/sweep/trial.py): each is the history
    row of its epoch, in order, whatever the human line beside it says."""
    with caplog.at_level("INFO", logger="tasks.training.loop"):
        result = train_once(shards, tmp_path)
    records = [r for r in (read_epoch_line(f"[train] {m}") for m in caplog.messages) if r is not None]
    assert records == read_json(result.model_path.parent / "history.json") and len(records) == 2


def test_rerun_after_completion_resumes_and_writes_the_same_files(shards: Path, tmp_path: Path) -> None:
    first = train_once(shards, tmp_path)
    files = {name: md5(tmp_path / name) for name in ("model.pt", "history.json", "train_run.json")}
    (tmp_path / "model.pt").unlink()
    again = train_once(shards, tmp_path)
    assert first.resumed_from_step == 0 and again.resumed_from_step == read_json(tmp_path / "train_run.json")["steps"]
    assert {name: md5(tmp_path / name) for name in files} == files


def test_checkpoint_from_other_params_is_refused_unless_fresh(shards: Path, model: Path, tmp_path: Path) -> None:
    other = train_once(shards, tmp_path / "other", lr=0.02)
    mine = model.parent / "runs" / "checkpoints" / read_json(model.parent / "train_run.json")["run"]
    target = tmp_path / "mine" / "runs" / "checkpoints" / mine.name
    target.mkdir(parents=True)
    (target / "last.pt").write_bytes((other.run_dir / "last.pt").read_bytes())  # a checkpoint in the wrong place
    with pytest.raises(CheckpointError, match=r"made from other params .*refusing to resume"):
        train_once(shards, tmp_path / "mine")
    fresh = train_once(shards, tmp_path / "mine", resume=False)
    assert fresh.resumed_from_step == 0 and md5(fresh.model_path) == md5(model)


def test_planted_nan_is_caught_named_and_never_checkpointed(
    shards: Path, model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plant(monkeypatch, "nan-grad@step:3:layer2.0.conv1.weight")
    with pytest.raises(NonFiniteError, match=r"step 3: non-finite gradient; .*layer2\.0\.conv1\.weight"):
        train_once(shards, tmp_path / "abort", nonfinite="abort", checkpoint_every_steps=1)
    last = next((tmp_path / "abort" / "runs" / "checkpoints").glob("*/last.pt"))
    state = torch.load(last, weights_only=True)
    assert state["progress"]["step"] == 2  # the last good one, intact
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
    assert not (tmp_path / "abort" / "model.pt").exists()

    plant(monkeypatch, "nan@step:2")
    result = train_once(shards, tmp_path / "skip", nonfinite="skip", checkpoint_every_steps=1)
    meta = read_json(tmp_path / "skip" / "train_run.json")
    assert meta["nonfinite_steps"] == [{"step": 2, "loss_finite": False, "first_parameter": "conv1.weight"}]
    assert meta["optimizer_updates"] == meta["steps"] - 1 and md5(result.model_path) != md5(model)


def test_planted_oom_takes_the_auto_batch_path(shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plant(monkeypatch, "oom@step:2")
    train_once(shards, tmp_path / "auto", auto_batch=True)
    meta = read_json(tmp_path / "auto" / "train_run.json")
    assert meta["auto_batch"] == [{"step": 2, "micro_batch": 8, "accumulation": 2}]
    assert meta["global_batch"] == 16 and meta["micro_batch"] == 8 and meta["optimizer_updates"] == meta["steps"]
    # Hooks are a test's: the run record and the model's provenance say which file, by hash.
    planted_by = meta["test_hooks"]
    assert planted_by.endswith(")") and "tests/helpers/faults.py (sha256 " in planted_by
    assert load_model_file(tmp_path / "auto" / "model.pt")[2]["provenance"]["test_hooks"] == planted_by

    plant(monkeypatch, "oom@step:1")
    with pytest.raises(StageError, match=r"out of memory at step 1: micro-batch 16 .* images 3x32x32, resnet18.*RSS"):
        train_once(shards, tmp_path / "plain")


def test_fine_tune_on_other_classes_frozen_and_full(shards: Path, model: Path, tmp_path: Path) -> None:
    other = make_shards(tmp_path / "four", classes=4, per_class=18, seed=7)
    source = torch.load(model, weights_only=True)["state_dict"]
    for frozen in (True, False):
        out = tmp_path / f"frozen-{frozen}"
        train_once(other, out, init_from=model, freeze_backbone=frozen, backbone_lr_scale=0.1)
        meta = read_json(out / "train_run.json")
        assert [s["name"] for s in meta["init_from"]["skipped"]] == ["fc.weight", "fc.bias"]
        assert meta["init_from"]["sha256"] == hashlib.sha256(model.read_bytes()).hexdigest()
        tuned = torch.load(out / "model.pt", weights_only=True)
        assert tuned["provenance"]["init_from_sha256"] == meta["init_from"]["sha256"]
        backbone = [k for k in source if not k.startswith("fc.")]
        unchanged = [k for k in backbone if torch.equal(tuned["state_dict"][k], source[k])]
        if frozen:  # every backbone tensor, BatchNorm statistics included
            assert unchanged == backbone and meta["frozen_parameters"] == 60
        else:
            assert len(unchanged) < len(backbone) // 10
        assert tuned["state_dict"]["fc.weight"].shape == (4, 512)


def test_sanity_memorises_one_batch_and_fails_on_a_broken_data_path(shards: Path, tmp_path: Path) -> None:
    check = PARAMS.sanity.model_copy(update={"steps": 60, "batch_size": 8, "lr": 0.01, "max_loss": 0.05})
    result = sanity.run(PARAMS.train, check, seed=0, shard_dir=shards, report_path=tmp_path / "ok.json")
    assert result.passed and result.final_loss < 0.05 < result.first_loss
    assert read_json(tmp_path / "ok.json")["reached_at_step"] == result.reached_at_step

    # The same pixels in every image whatever its class (files differ only in a PNG text chunk, so they
    # are not byte duplicates): no model can tell them apart, as when a data path blanks its images.
    blank = tmp_path / "blank"
    for c in range(3):
        (blank / "images" / f"class_{c}").mkdir(parents=True)
        for i in range(8):
            info = PngImagePlugin.PngInfo()
            info.add_text("id", f"{c}-{i}")
            Image.fromarray(np.full((40, 40, 3), 128, np.uint8)).save(
                blank / "images" / f"class_{c}" / f"{i}.png", pnginfo=info
            )
    preprocess.run(PARAMS.preprocess, seed=0, source=blank / "images", out_dir=blank / "shards")
    recipe = PARAMS.train.model_copy(update={"precision": "fp32"})  # bf16 BatchNorm on constant input goes NaN
    broken = sanity.run(recipe, check, seed=0, shard_dir=blank / "shards", report_path=tmp_path / "bad.json")
    assert not broken.passed and broken.final_loss > 0.5 and broken.steps == 60
    assert broken.reason == "loss still above 0.05 after 60 steps"


@pytest.mark.slow
def test_compiled_training_writes_checkpoints_that_load_without_compile(shards: Path, tmp_path: Path) -> None:
    result = train_once(shards, tmp_path, compile=True, epochs=1)
    state = torch.load(result.run_dir / "last.pt", weights_only=True)["model"]
    assert not any(key.startswith(("_orig_mod.", "module.")) for key in state)
    plain = build_model("resnet18", 3)
    plain.load_state_dict(state)
    loaded, _, _ = load_model_file(result.model_path)
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in loaded.state_dict().items())
    again = train_once(shards, tmp_path, compile=False, epochs=1)  # the same run, resumed without compile
    assert again.resumed_from_step == read_json(tmp_path / "train_run.json")["steps"] > 0


def test_finished_runs_prune_older_runs_checkpoints(shards: Path, tmp_path: Path) -> None:
    """Each params change is a new run folder (about 90 MB for resnet18): only the newest few stay."""
    first = train_once(shards, tmp_path, epochs=1, keep_checkpoint_runs=2)
    second = train_once(shards, tmp_path, epochs=1, lr=0.02, keep_checkpoint_runs=2)
    assert {p.name for p in (tmp_path / "runs/checkpoints").iterdir()} == {first.run_dir.name, second.run_dir.name}
    third = train_once(shards, tmp_path, epochs=1, lr=0.03, keep_checkpoint_runs=2)
    assert {p.name for p in (tmp_path / "runs/checkpoints").iterdir()} == {second.run_dir.name, third.run_dir.name}


def test_batch_grids_show_the_first_real_batch_and_the_val_images(shards: Path, model: Path) -> None:
    from tasks.core.params import derive_seed
    from tasks.training.augment import Augment
    from tasks.training.batches import first_batch
    from tasks.training.dataset import ShardDataset
    from tasks.training.distributed import World
    from tasks.training.loader import StepSampler, make_loader
    from tasks.training.start import training_start

    for name in ("train_batch.png", "val_batch.png"):
        with Image.open(model.parent / name) as grid:
            assert grid.format == "PNG" and grid.width > 400, name
    # The grid's batch is the loop's: a loader built as the train stage builds it, with 2 workers,
    # yields the same first batch as the grid's copy (the seed derivation is the stage's own).
    params = PARAMS.train
    seed = derive_seed(PARAMS.seed, "train")
    resolved = training_start(params, seed=PARAMS.seed, shard_dir=shards, pretrained_dir=shards).params.augment
    dataset = ShardDataset(shards, "train", augment=Augment(resolved), seed=seed)
    generator = torch.Generator().manual_seed(derive_seed(seed, "loader"))
    state = generator.get_state()
    loader = make_loader(dataset, StepSampler(len(dataset), params.batch_size, World(), generator), num_workers=2,
                         pin_memory=False, generator=generator)  # fmt: skip
    real_images, real_labels, indices = next(iter(loader))
    images, labels = first_batch(dataset, params.batch_size, state)
    assert torch.equal(images, real_images) and labels == real_labels.tolist()
    raw = torch.from_numpy(dataset.data.take(indices.tolist()))
    assert not torch.equal(images, raw)  # augmented: what the model gets, not the stored pixels


def test_training_hooks_are_refused_unless_allowed(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plant(monkeypatch, "nan@step:2")
    monkeypatch.delenv("IMAGEPIPE_ALLOW_TEST_HOOKS")
    with pytest.raises(StageError, match=r"IMAGEPIPE_TRAIN_HOOKS=.*faults.py: training hooks are for tests and are "
                                         r"not loaded without IMAGEPIPE_ALLOW_TEST_HOOKS=1"):  # fmt: skip
        train_once(shards, tmp_path / "refused")
    assert not (tmp_path / "refused" / "model.pt").exists()
    monkeypatch.delenv("IMAGEPIPE_TRAIN_HOOKS")
    train_once(shards, tmp_path / "plain", epochs=1)
    assert read_json(tmp_path / "plain" / "train_run.json")["test_hooks"] is None
    assert "test_hooks" not in load_model_file(tmp_path / "plain" / "model.pt")[2]["provenance"]
