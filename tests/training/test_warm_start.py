"""train.warm_start: the production model's weights (make warm-start) shrunk and perturbed into the next run.

The parent is a model the test trains, promotes and hands to `make warm-start`'s run(): the whole path from
the promoted baseline to the lineage in the new model, with real files and a real ONNX export."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tasks import train
from tasks.core.errors import StageError
from tasks.core.io import read_json, sha256_file, write_json
from tasks.core.params import ParamsError, WarmStartParams, parse_params
from tasks.core.paths import Paths
from tasks.tools import warm_start as warm_start_tool
from tasks.training.models import build_model, save_model_file
from tasks.training.warm_start import PARENT_MODEL, PARENT_RECORD, WarmStartError, warm_start
from tests.helpers.export import ONNX_ONLY, check, export_model, promote_to
from tests.helpers.training import PARAMS, SPEC

SHRINK_PERTURB = WarmStartParams(enabled=True, shrink=0.4, perturb=0.2)


def plant_parent(folder: Path, model: torch.nn.Module, class_names: tuple[str, ...], arch: str = "resnet18") -> Path:
    """A model.pt and the parent.json make warm-start writes beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = SPEC.model_copy(update={"class_names": class_names})
    save_model_file(folder / PARENT_MODEL, model, arch=arch, spec=spec, provenance={})
    write_json(folder / PARENT_RECORD, {"model_sha256": sha256_file(folder / PARENT_MODEL), "onnx_sha256": "o" * 64,
                                        "source": "baseline"})  # fmt: skip
    return folder


def test_every_weight_is_shrunk_and_perturbed_and_the_head_rows_follow_the_class_names(tmp_path: Path) -> None:
    torch.manual_seed(1)
    parent = build_model("resnet18", 3)
    with torch.no_grad():  # running statistics of its own, so the test sees they are the parent's
        parent.bn1.running_mean.uniform_(0, 1)
    folder = plant_parent(tmp_path / "parent", parent, ("cat", "dog", "owl"))
    torch.manual_seed(2)
    child = build_model("resnet18", 3)  # this run's classes: owl and cat kept, dog gone, fox new
    fresh = {k: v.clone() for k, v in child.state_dict().items()}
    record = warm_start(child, SHRINK_PERTURB, "resnet18", ["fox", "owl", "cat"], folder)
    mine, theirs = child.state_dict(), parent.state_dict()
    assert torch.allclose(mine["conv1.weight"], 0.4 * theirs["conv1.weight"] + 0.2 * fresh["conv1.weight"])
    assert torch.allclose(mine["bn1.weight"], 0.4 * theirs["bn1.weight"] + 0.2 * fresh["bn1.weight"])
    assert torch.equal(mine["bn1.running_mean"], theirs["bn1.running_mean"])
    assert torch.equal(mine["fc.weight"][0], fresh["fc.weight"][0])  # fox: the parent never saw it
    assert torch.allclose(mine["fc.weight"][1], 0.4 * theirs["fc.weight"][2] + 0.2 * fresh["fc.weight"][1])  # owl
    assert torch.allclose(mine["fc.bias"][2], 0.4 * theirs["fc.bias"][0] + 0.2 * fresh["fc.bias"][2])  # cat
    lineage = record["warm_start"]
    assert record["sha256"] == lineage["parent_model_sha256"] == sha256_file(folder / PARENT_MODEL)
    assert lineage["new_classes"] == ["fox"] and lineage["dropped_classes"] == ["dog"]
    assert lineage["classes_from_parent"] == 2 and lineage["fresh_tensors"] == []


def test_a_plain_warm_start_is_the_parent_itself(tmp_path: Path) -> None:
    torch.manual_seed(1)
    parent = build_model("resnet18", 2)
    folder = plant_parent(tmp_path / "parent", parent, ("a", "b"))
    child = build_model("resnet18", 2)
    warm_start(child, WarmStartParams(enabled=True, shrink=1.0, perturb=0.0), "resnet18", ["a", "b"], folder)
    assert all(torch.equal(child.state_dict()[k], v) for k, v in parent.state_dict().items())


def test_a_missing_altered_or_foreign_parent_is_refused_in_one_line(tmp_path: Path) -> None:
    model = build_model("resnet18", 2)
    with pytest.raises(WarmStartError, match=r"parent/model.pt does not exist; `make warm-start` puts"):
        warm_start(model, SHRINK_PERTURB, "resnet18", ["a", "b"], tmp_path / "parent")
    (tmp_path / "tracked").mkdir()
    (tmp_path / "tracked" / "model.pt.dvc").write_text("outs: []\n")
    with pytest.raises(WarmStartError, match=r"tracked by DVC but missing; run `dvc pull .*model.pt.dvc`"):
        warm_start(model, SHRINK_PERTURB, "resnet18", ["a", "b"], tmp_path / "tracked")
    folder = plant_parent(tmp_path / "parent", build_model("resnet18", 2), ("a", "b"))
    with pytest.raises(WarmStartError, match=r"is a resnet18 model, train.arch is resnet34"):
        warm_start(build_model("resnet34", 2), SHRINK_PERTURB, "resnet34", ["a", "b"], folder)
    with open(folder / PARENT_MODEL, "ab") as handle:  # bytes that are not the ones make warm-start recorded
        handle.write(b"\0")
    with pytest.raises(WarmStartError, match=r"model.pt has sha256 .*parent.json records .*make warm-start"):
        warm_start(model, SHRINK_PERTURB, "resnet18", ["a", "b"], folder)


def test_warm_start_and_another_start_together_are_refused() -> None:
    with pytest.raises(ParamsError, match=r"train.warm_start.enabled and train.pretrained are both set"):
        parse_params({"train": {"pretrained": "DEFAULT", "warm_start": {"enabled": True}}})
    with pytest.raises(ParamsError, match=r"train.warm_start.enabled and train.init_from are both set"):
        parse_params({"train": {"init_from": "m.pt", "warm_start": {"enabled": True}}})


def test_the_promoted_model_becomes_the_parent_and_the_next_model_records_its_lineage(
    export_shards: Path, export_model_file: Path, tmp_path: Path
) -> None:
    project = tmp_path / "project"
    export_model(export_shards, export_model_file, project, ONNX_ONLY)
    assert check(project, export_shards, project / "baseline").passed
    promote_to(project, export_model_file, export_shards, project / "baseline")
    assert sha256_file(project / "baseline/model.pt") == sha256_file(export_model_file)  # promote keeps the weights
    paths = Paths(baseline=project / "baseline", model=tmp_path / "elsewhere.pt", onnx=project / "models/model.onnx",
                  reports=project / "reports", parent=tmp_path / "parent")  # fmt: skip
    record = warm_start_tool.run(paths, track_with_dvc=False)
    assert record["source"] == "baseline" and record["model_sha256"] == sha256_file(export_model_file)
    assert record["onnx_sha256"] == sha256_file(project / "models/model.onnx")
    assert read_json(tmp_path / "parent" / PARENT_RECORD) == record

    out = tmp_path / "child"
    params = PARAMS.train.model_copy(update={"warm_start": SHRINK_PERTURB})
    train.run(params, seed=PARAMS.seed, shard_dir=export_shards, model_path=out / "model.pt",
              history_path=out / "h.json", plot_path=out / "h.png", runs_dir=out / "runs", provenance={},
              parent_dir=tmp_path / "parent")  # fmt: skip
    provenance = torch.load(out / "model.pt", weights_only=True)["provenance"]
    assert provenance["parent_model_sha256"] == sha256_file(export_model_file)
    assert provenance["parent_onnx_sha256"] == record["onnx_sha256"]
    assert provenance["warm_start"] == "shrink 0.4, perturb 0.2"
    run = read_json(out / "train_run.json")
    assert run["warm_start"]["parent_model_sha256"] == sha256_file(export_model_file)
    assert run["init_from"] is None and run["pretrained"] is None


def test_make_warm_start_refuses_weights_that_are_not_the_production_models(
    export_shards: Path, export_model_file: Path, tmp_path: Path
) -> None:
    project = tmp_path / "project"
    export_model(export_shards, export_model_file, project, ONNX_ONLY)
    other = tmp_path / "other.pt"
    shutil.copyfile(export_model_file, other)
    with open(other, "ab") as handle:
        handle.write(b"\0")
    paths = Paths(baseline=project / "no-baseline", model=other, onnx=project / "models/model.onnx",
                  reports=project / "reports", parent=tmp_path / "parent")  # fmt: skip
    with pytest.raises(StageError, match=r"other.pt has sha256 .*was exported from .*run `dvc repro`"):
        warm_start_tool.run(paths, track_with_dvc=False)
    assert not (tmp_path / "parent").exists() or not any((tmp_path / "parent").iterdir())
