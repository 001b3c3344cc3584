"""train.pretrained: the published weights for train.arch, from a file DVC tracks -> the model's start. timm's
models (train.arch timm/<name>) take timm's pretrained tags from the Hugging Face hub (tasks/training/
timm_weights.py); torchvision's, as follows.

The weights are named as torchvision names them (`IMAGENET1K_V1`, `DEFAULT`, ...) and resolved with
`torchvision.models.get_weight`; the file is the one torchvision publishes, under its own name
(`resnet18-f37072fd.pth`, whose `-<hex>.` is the start of its sha256) in paths.pretrained. `make add-weights`
puts it there (`dvc import-url` of its URL, or `dvc add` of a copy you have) and a second machine gets it
with `dvc pull`: nothing downloads at run time. Every tensor but the classifier head must match train.arch.
A file under torchvision's name whose sha256 does not start with the hash in that name is refused before it
is loaded: your own weights are `train.init_from`, never the published name.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torchvision.models import get_model_weights, get_weight

from tasks.core.errors import StageError
from tasks.core.io import sha256_file
from tasks.core.params import TIMM_PREFIX, TrainParams
from tasks.core.paths import Paths
from tasks.images.imaging import PreprocessSpec
from tasks.training import timm_weights
from tasks.training.checkpoint import load_init_weights, read_state
from tasks.training.models import head_name
from tasks.training.warm_start import warm_start

log = logging.getLogger(__name__)
HASH_IN_NAME = re.compile(r"-([a-f0-9]+)\.")  # torch.hub's HASH_REGEX: the file name carries its sha256's start


class WeightsError(StageError):
    """Pretrained weights that cannot be used; the message names the key, the file and the fix."""


@dataclass(frozen=True)
class Published:
    """One entry of torchvision's weights registry, or one of timm's pretrained tags (hub set)."""

    arch: str
    name: str  # the enum member's own name, or timm's tag (DEFAULT resolved)
    url: str
    mean: tuple[float, ...]
    std: tuple[float, ...]
    crop_size: int
    hub: str | None = None  # timm's: the Hugging Face repository (timm/<name>.<tag>)
    interpolation: str = "bilinear"

    @property
    def filename(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def sha256_prefix(self) -> str:
        found = HASH_IN_NAME.search(self.filename)
        return found.group(1) if found else ""

    def add_command(self) -> str:
        return f"make add-weights ARCH={self.arch} WEIGHTS={self.name}"


def published(arch: str, name: str) -> Published:
    """`name` of the published weights for `arch` (train.pretrained), or a WeightsError listing the valid ones."""
    if arch.startswith(TIMM_PREFIX):
        try:
            tag, cfg = timm_weights.tag_config(arch, name)
        except StageError as exc:
            raise WeightsError(str(exc)) from None
        url = f"https://huggingface.co/{cfg.hf_hub_id}/resolve/main/{timm_weights.HUB_FILE}"
        return Published(arch, tag, url, tuple(cfg.mean), tuple(cfg.std), int(cfg.input_size[-1]), cfg.hf_hub_id,
                         cfg.interpolation)  # fmt: skip
    enum = get_model_weights(arch)
    valid = [*enum.__members__]
    if name not in valid:
        raise WeightsError(f"train.pretrained {name!r}: torchvision has no such weights for {arch}; valid: {valid}")
    weights = get_weight(f"{enum.__name__}.{name}")
    transform = weights.transforms()
    return Published(arch, weights.name, weights.url, tuple(transform.mean), tuple(transform.std),
                     int(transform.crop_size[0]))  # fmt: skip


def weights_file(folder: Path, weights: Published) -> Path:
    if weights.hub is not None:
        return timm_weights.weights_path(folder, weights.arch, weights.name)
    return Path(folder) / weights.filename


def is_published(sha256: str, weights: Published, path: Path | None = None) -> bool:
    """Does a file's sha256 start with the hash that its name (torchvision's, or the one add-weights gave timm's)
    carries?"""
    found = HASH_IN_NAME.search(path.name if path is not None else weights.filename)
    return found is not None and sha256.startswith(found.group(1))


def check_spec(weights: Published, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
    """The shards' normalisation must be the one the weights were trained with."""
    if tuple(round(x, 6) for x in mean) != weights.mean or tuple(round(x, 6) for x in std) != weights.std:
        raise WeightsError(
            f"train.pretrained {weights.arch} {weights.name} expects preprocess.mean {list(weights.mean)} and std "
            f"{list(weights.std)}, the shards have {list(mean)} and {list(std)}: set them in params.yaml"
        )


def load_pretrained(model: torch.nn.Module, folder: Path, weights: Published) -> dict[str, Any]:
    """Load every tensor but the head from the weights file into `model`; returns the transfer record."""
    path = weights_file(folder, weights)
    if not path.is_file():
        raise WeightsError(
            f"train.pretrained {weights.name}: {path} is missing; `dvc pull {path}.dvc` if it is in the remote, "
            f"else `{weights.add_command()}` on a machine with internet (downloads {weights.url})"
        )
    digest = sha256_file(path)
    if not is_published(digest, weights, path):  # refused before a byte is loaded: the name promises the file
        raise WeightsError(
            f"train.pretrained {weights.name}: {path} is not the published file (its sha256 {digest[:12]} does not "
            f"start with {HASH_IN_NAME.search(path.name).group(1)}, the hash in its name); to start from your own "  # type: ignore[union-attr]
            "weights, "
            f"move the file elsewhere and point train.init_from at it, or `{weights.add_command()}` brings the "
            "published one"
        )
    try:
        state = read_state(path)
    except Exception as exc:
        raise WeightsError(f"train.pretrained: {path} is not a state dict torch loads ({type(exc).__name__})") from None
    own, head = model.state_dict(), head_name(model)
    body = {key for key in own if not key.startswith(head + ".")}
    if not isinstance(state, dict):
        raise WeightsError(f"train.pretrained: {path} holds no state dict (name -> tensor)")
    wrong = sorted(k for k in body if k not in state or tuple(state[k].shape) != tuple(own[k].shape))
    wrong += sorted(k for k in state if k not in own)  # a deeper model of the same family has more
    if wrong:
        raise WeightsError(
            f"train.pretrained: {path} is not a {weights.arch} state dict: {len(wrong)} of its {len(body)} backbone "
            f"tensors are missing, extra or of another shape (first: {wrong[0]}); `{weights.add_command()}` brings the "
            "right file"
        )
    record = load_init_weights(model, path, what="train.pretrained")
    return {**record, "weights": f"{weights.arch}.{weights.name}", "url": weights.url,
            "published_file": is_published(record["sha256"], weights, path),
            "config": {"crop_size": weights.crop_size, "interpolation": weights.interpolation,
                       "mean": list(weights.mean), "std": list(weights.std)}}  # fmt: skip


def start_weights(
    model: torch.nn.Module, params: TrainParams, spec: PreprocessSpec, pretrained_dir: Path,
    parent_dir: Path | None = None,
) -> dict[str, Any] | None:  # fmt: skip
    """What the model starts from: train.pretrained, train.init_from, train.warm_start's parent (paths.parent) or
    nothing; the transfer record."""
    if params.warm_start.enabled:
        return warm_start(model, params.warm_start, params.arch, list(spec.class_names), parent_dir or Paths().parent)
    if params.pretrained:
        weights = published(params.arch, params.pretrained)
        check_spec(weights, spec.mean, spec.std)
        return load_pretrained(model, pretrained_dir, weights)
    if params.init_from:
        return load_init_weights(model, params.init_from)
    return None
