"""Models by name (torchvision's classification models, timm's as timm/<name>), the model file (weights + spec +
provenance), and input normalisation.

A name that is no model is refused in one line with the nearest names; a model whose head (the classifier
transfer learning replaces: timm's `get_classifier()`, torchvision's last Linear) cannot be found is refused too.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision

from tasks.core.blocks import batches, block_rows
from tasks.core.errors import StageError
from tasks.core.io import atomic_file
from tasks.core.params import TIMM_PREFIX
from tasks.images.imaging import PreprocessSpec
from tasks.images.shards import ShardSplit


class ModelError(StageError):
    """train.arch names no model this project can train; the message names it and the nearest names."""


def _refuse(arch: str, names: list[str], where: str) -> ModelError:
    near = difflib.get_close_matches(arch.removeprefix(TIMM_PREFIX), names, n=3, cutoff=0.6)
    prefix = TIMM_PREFIX if arch.startswith(TIMM_PREFIX) else ""
    hint = f"; nearest: {', '.join(prefix + n for n in near)}" if near else ""
    return ModelError(f"train.arch {arch!r}: {where}{hint}")


def check_arch(arch: str) -> None:
    """Raise ModelError unless `arch` names a model: timm's by `timm.is_model`, torchvision's among its
    classification models (what a sweep's choices are checked by before any trial runs)."""
    if arch.startswith(TIMM_PREFIX):
        import timm  # only for timm's models: its import costs a second

        name = arch.removeprefix(TIMM_PREFIX)
        if not timm.is_model(name):
            raise _refuse(arch, timm.list_models(), f"timm {timm.__version__} has no model {name!r}")
        return
    names = torchvision.models.list_models(module=torchvision.models)  # classification models only
    if arch not in names:
        raise _refuse(arch, names, "no torchvision classification model of that name (timm's: timm/<name>)")


def build_model(arch: str, num_classes: int) -> torch.nn.Module:
    """`arch` with a new head of `num_classes`, randomly initialised (its weights: tasks/training/pretrained.py)."""
    check_arch(arch)
    if arch.startswith(TIMM_PREFIX):
        import timm

        model = timm.create_model(arch.removeprefix(TIMM_PREFIX), pretrained=False, num_classes=num_classes)
    else:
        model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
    try:
        head_name(model)
    except ValueError as exc:
        raise ModelError(f"train.arch {arch!r}: {exc}, which transfer learning and freezing need") from None
    return model


def head_name(model: torch.nn.Module) -> str:
    """The classifier layer: what transfer learning replaces and a frozen backbone trains. timm's models say which
    (`get_classifier()`); torchvision's is the last Linear."""
    if hasattr(model, "get_classifier") and hasattr(model, "pretrained_cfg"):
        classifier = model.get_classifier()
        named = [name for name, module in model.named_modules() if module is classifier and name]
        if named:
            return named[0]
        raise ValueError(f"{type(model).__name__}'s classifier is not one of its modules")
    names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    if not names:
        raise ValueError(f"{type(model).__name__} has no Linear layer to use as the head")
    return names[-1]


def for_export(model: torch.nn.Module) -> torch.nn.Module:
    """The model as it is served: timm's reparameterisable models (MobileOne, RepViT, FastViT) fused into their
    inference form (the same function, fewer layers); others as they are."""
    if hasattr(model, "pretrained_cfg"):
        from timm.utils.model import reparameterize_model

        return reparameterize_model(model.eval())
    return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module inside DDP and torch.compile wrappers, so saved keys never carry prefixes."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model)


def normalize(images: torch.Tensor, spec: PreprocessSpec) -> torch.Tensor:
    """uint8 (N, 3, H, W) -> float32 normalised with the spec's mean and std."""
    mean = torch.tensor(spec.mean, dtype=torch.float32, device=images.device).view(1, 3, 1, 1) * 255.0
    std = torch.tensor(spec.std, dtype=torch.float32, device=images.device).view(1, 3, 1, 1) * 255.0
    return (images.float() - mean) / std


def save_model_file(
    path: Path, model: torch.nn.Module, *, arch: str, spec: PreprocessSpec, provenance: dict[str, str],
    calibration: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    """`calibration`: the temperature fitted after training (tasks/training/temperature.py), when there is one."""
    payload = {
        "arch": arch,
        "spec": spec.model_dump(mode="json"),
        "provenance": provenance,
        **({"calibration": calibration} if calibration is not None else {}),
        "state_dict": {k: v.detach().cpu().contiguous() for k, v in unwrap(model).state_dict().items()},
    }
    with atomic_file(path) as handle:
        torch.save(payload, handle)


def load_model_file(path: Path) -> tuple[torch.nn.Module, PreprocessSpec, dict[str, Any]]:
    payload = torch.load(path, map_location="cpu", weights_only=True)
    spec = PreprocessSpec.model_validate(payload["spec"])
    model = build_model(payload["arch"], len(spec.class_names))
    model.load_state_dict(payload["state_dict"])
    return model.eval(), spec, payload


@torch.no_grad()
@torch.inference_mode()
def predict_logits(
    model: torch.nn.Module, images: np.ndarray | Iterable[np.ndarray], spec: PreprocessSpec, batch_size: int = 256
) -> np.ndarray:
    """uint8 (N, 3, H, W), or its rows in blocks (a split streamed: ShardSplit.blocks, the same batches whatever
    the blocks) -> float32 logits (N, classes), fp32, model in eval mode, on the model's device."""
    model.eval()
    device = next(model.parameters()).device
    outputs = [
        model(normalize(torch.from_numpy(batch.copy()).to(device), spec)).float().cpu()
        for batch in batches(images, batch_size)
    ]
    return torch.cat(outputs).numpy() if outputs else np.zeros((0, len(spec.class_names)), np.float32)


def split_logits(
    model: torch.nn.Module, split: ShardSplit, spec: PreprocessSpec, batch_size: int = 256,
    indices: np.ndarray | None = None,
) -> np.ndarray:  # fmt: skip
    """predict_logits on a split's images (or those at `indices`, in their order), read a block at a time: memory
    holds one block of pixels and the logits, whatever the split's size; the same bits as on all_images()."""
    return predict_logits(model, split.blocks(block_rows(spec.image_size, batch_size), indices), spec, batch_size)
