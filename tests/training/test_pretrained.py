"""train.pretrained: torchvision's registry, the DVC-tracked weights file, and every way it can be wrong.

No weights are downloaded: the tests make a state dict of the right architecture and plant it under the name
torchvision publishes it with, where the loader looks (paths.pretrained)."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest
import torch
import torchvision

from tasks.core.errors import StageError
from tasks.core.params import ParamsError, parse_params
from tasks.tools import add_weights
from tasks.training.models import build_model
from tasks.training.pretrained import Published, WeightsError, check_spec, load_pretrained, published
from tests.helpers.project import commit, dvc, make_project, sh

RESNET18 = published("resnet18", "IMAGENET1K_V1")


def plant(folder: Path, model: torch.nn.Module, name: str = RESNET18.filename) -> Path:
    """A torchvision-style state dict (1000-class head, like ImageNet weights) where the loader looks."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), folder / name)
    return folder / name


def published_as(folder: Path, model: torch.nn.Module) -> tuple[Path, Published]:
    """`model`'s state dict planted as torchvision publishes a file, under a name that carries its own sha256's
    start, and the registry entry for it (RESNET18's, but for the URL): the loader's whole path, hash check
    included, with a file the test makes."""
    path = plant(folder, model, "staging.pth")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    name = f"{RESNET18.arch}-{digest[:8]}.pth"
    path.rename(folder / name)
    return folder / name, dataclasses.replace(RESNET18, url=f"{RESNET18.url.rsplit('/', 1)[0]}/{name}")


def test_weights_resolve_through_torchvisions_registry() -> None:
    default = published("resnet18", "DEFAULT")
    assert default == RESNET18 and RESNET18.filename == "resnet18-f37072fd.pth" and RESNET18.sha256_prefix == "f37072fd"
    assert RESNET18.mean == (0.485, 0.456, 0.406) and RESNET18.crop_size == 224
    assert published("resnet50", "IMAGENET1K_V2").url.endswith("resnet50-11ad3fa6.pth")
    valid = r"valid: \['IMAGENET1K_V1', 'IMAGENET1K_V2', 'DEFAULT'\]"
    with pytest.raises(WeightsError, match=r"'IMAGENET22K': torchvision has no such weights for resnet50; " + valid):
        published("resnet50", "IMAGENET22K")


def test_pretrained_and_init_from_together_are_refused() -> None:
    expected = r"train.init_from: .*train.pretrained \(DEFAULT\) is set too.*\(got .m.pt.\)"
    with pytest.raises(ParamsError, match=expected):
        parse_params({"train": {"pretrained": "DEFAULT", "init_from": "m.pt"}})


def test_a_missing_file_names_the_command_and_the_url(tmp_path: Path) -> None:
    with pytest.raises(WeightsError) as caught:
        load_pretrained(build_model("resnet18", 3), tmp_path, RESNET18)
    message = str(caught.value)
    assert "\n" not in message and f"{tmp_path}/resnet18-f37072fd.pth is missing" in message
    assert "make add-weights ARCH=resnet18 WEIGHTS=IMAGENET1K_V1" in message and RESNET18.url in message


@pytest.mark.parametrize("other", ["mobilenet_v3_small", "resnet34"])
def test_a_file_of_another_arch_is_refused(tmp_path: Path, other: str) -> None:
    _, weights = published_as(tmp_path, getattr(torchvision.models, other)(weights=None))
    model = build_model("resnet18", 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(WeightsError, match=rf"{weights.filename} is not a resnet18 state dict: \d+ of its"):
        load_pretrained(model, tmp_path, weights)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing was loaded


def test_weights_load_all_but_the_head(tmp_path: Path) -> None:
    torch.manual_seed(1)
    source = torchvision.models.resnet18(weights=None)  # 1000 classes, as ImageNet's
    path, weights = published_as(tmp_path, source)
    model = build_model("resnet18", 3)
    record = load_pretrained(model, tmp_path, weights)
    assert record["weights"] == "resnet18.IMAGENET1K_V1" and record["url"] == weights.url
    assert record["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest() and record["published_file"] is True
    assert [s["name"] for s in record["skipped"]] == ["fc.weight", "fc.bias"]
    assert torch.equal(model.layer4[1].conv2.weight, source.layer4[1].conv2.weight)


def test_a_file_under_torchvisions_name_that_is_not_the_published_one_is_refused(tmp_path: Path) -> None:
    """Your own weights under the published name: refused before anything loads, naming train.init_from."""
    path = plant(tmp_path, torchvision.models.resnet18(weights=None))
    model = build_model("resnet18", 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(WeightsError) as caught:
        load_pretrained(model, tmp_path, RESNET18)
    message = str(caught.value)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert "\n" not in message
    assert f"{path} is not the published file (its sha256 {digest[:12]} does not start" in message
    assert "does not start with f37072fd" in message and "point train.init_from at it" in message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_shards_normalisation_must_be_the_weights_own() -> None:
    check_spec(RESNET18, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    with pytest.raises(WeightsError, match=r"expects preprocess.mean \[0.485, 0.456, 0.406\] and std .* the shards "
                                           r"have \[0.5, 0.5, 0.5\]"):  # fmt: skip
        check_spec(RESNET18, (0.5, 0.5, 0.5), (0.229, 0.224, 0.225))


def test_add_weights_refuses_a_file_whose_hash_does_not_match(tmp_path: Path) -> None:
    src = plant(tmp_path / "downloads", torchvision.models.resnet18(weights=None))
    folder = tmp_path / "models" / "pretrained"
    params = tmp_path / "params.yaml"
    params.write_text("train:\n  arch: resnet34\n")
    with pytest.raises(
        StageError,
        match=r"SRC .*: sha256 [0-9a-f]{16}\.\.\. does not start with f37072fd, the hash "
        r"in torchvision's file name resnet18-f37072fd.pth: .* nothing was added",
    ):
        add_weights.run(RESNET18, folder=folder, src=src, params_file=params)
    assert not folder.exists() and params.read_text() == "train:\n  arch: resnet34\n"


def test_a_second_clone_gets_the_weights_with_dvc_pull(tmp_path: Path) -> None:
    """The file a test plants and `dvc add`s, pushed to a DVC remote, reaches another clone by `dvc pull`, and
    the train stage's dvc.lock entry depends on it."""
    repo = make_project(tmp_path / "one")
    path = plant(repo / "models" / "pretrained", torchvision.models.resnet18(weights=None))
    dvc("add", str(path.relative_to(repo)), cwd=repo)
    dvc("remote", "add", "-d", "store", str(tmp_path / "remote"), cwd=repo)
    dvc("push", cwd=repo)
    commit(repo, "weights")
    assert "resnet18-f37072fd.pth" in (repo / "models/pretrained/.gitignore").read_text()
    status = dvc("status", "train", "--json", cwd=repo, check=False).stdout
    assert "models/pretrained" in status  # a dependency of train (changed: it was never run here)
    sh(["git", "clone", "-q", str(repo), str(tmp_path / "two")], cwd=tmp_path)
    second = tmp_path / "two" / "models" / "pretrained" / RESNET18.filename
    assert not second.exists()
    dvc("pull", f"models/pretrained/{RESNET18.filename}.dvc", cwd=tmp_path / "two")
    assert second.read_bytes() == path.read_bytes()


def test_an_imported_file_whose_hash_does_not_match_leaves_nothing_behind(tmp_path: Path) -> None:
    """`dvc import-url` from a mirror (a local path here: nothing downloads in a test) of a file that is not the
    published one: refused after the import, which is undone (no file, no .dvc file, params.yaml as it was)."""
    import os

    repo = make_project(tmp_path / "repo")
    commit(repo, "the project")
    mirror = plant(tmp_path / "mirror", torchvision.models.resnet18(weights=None))
    params = (repo / "params.yaml").read_text()
    cwd = os.getcwd()
    os.chdir(repo)
    try:
        with pytest.raises(StageError, match=rf"{mirror}: sha256 [0-9a-f]{{16}}\.\.\. does not start with f37072fd"):
            add_weights.run(RESNET18, folder=Path("models/pretrained"), url=str(mirror))
    finally:
        os.chdir(cwd)
    assert sorted(p.name for p in (repo / "models/pretrained").iterdir()) == ["README.md"]
    assert (repo / "params.yaml").read_text() == params
    assert sh(["git", "status", "--porcelain"], cwd=repo).stdout == ""
