"""`make add-weights ARCH=resnet18 WEIGHTS=IMAGENET1K_V1`: published weights as a file DVC tracks.

timm's (ARCH=timm/<name> WEIGHTS=<tag>|DEFAULT [REVISION=<commit>]): the Hugging Face hub's model.safetensors of
the tag, downloaded with huggingface_hub and checked against the sha256 the hub stores it under, or SRC=<a copy>;
kept as <name>.<tag>-<sha256[:16]>.safetensors, `dvc add`ed, its hub repository and revision in the .dvc file's
meta (tasks/training/timm_weights.py). torchvision's:

Resolves the weights with torchvision's registry (`torchvision.models.get_weight`), then brings the file into
paths.pretrained under torchvision's own name (`resnet18-f37072fd.pth`):
  - by default `dvc import-url` of its URL (on a machine with internet; URL=... for a mirror of the same file),
  - or, with SRC=/path/to/resnet18-f37072fd.pth, `dvc add` of a copy you already have (torch hub keeps one
    in ~/.cache/torch/hub/checkpoints/).
The file's sha256 must start with the hash that torchvision's file name carries; a file that does not match is
refused and nothing stays behind. params.yaml's train.arch and train.pretrained are then set (DVC's own params
writer). Commit the .dvc file, the .gitignore and params.yaml, and `dvc push`: another machine gets the file
with `dvc pull`, and the train stage depends on it.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tasks.core.cli import stage_main
from tasks.core.errors import StageError
from tasks.core.io import sha256_file
from tasks.core.params import PARAMS_FILE, Params
from tasks.core.private_api import edit_yaml, set_params
from tasks.training import timm_weights
from tasks.training.models import build_model
from tasks.training.pretrained import Published, is_published, published, weights_file

log = logging.getLogger(__name__)


def _dvc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dvc", *args], capture_output=True, text=True)


def _refuse_mismatch(path: Path, weights: Published, what: str) -> None:
    digest = sha256_file(path)
    if not is_published(digest, weights):
        raise StageError(
            f"{what}: sha256 {digest[:16]}... does not start with {weights.sha256_prefix}, the hash in torchvision's "
            f"file name {weights.filename}: not the published {weights.arch} {weights.name} weights (a partial "
            "download, or another file); nothing was added"
        )


def _check_new(dest: Path) -> Path:
    record = dest.with_name(dest.name + ".dvc")
    if record.exists():
        raise StageError(f"{record} already exists: these weights are tracked; `dvc pull {record}` brings the file")
    if dest.exists():
        raise StageError(f"{dest} exists but is not tracked; move it away, or bring it in with SRC={dest}.moved")
    return record


def _add_copy(src: Path, dest: Path) -> None:
    """A copy of `src` renamed in as `dest`, then `dvc add`ed; nothing stays behind when that fails."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    try:
        shutil.copyfile(src, staging)
        os.replace(staging, dest)
    finally:
        staging.unlink(missing_ok=True)
    proc = _dvc("add", str(dest))
    if proc.returncode != 0:
        dest.unlink(missing_ok=True)
        raise StageError(f"dvc add {dest} failed, nothing was added:\n{proc.stdout}{proc.stderr}".rstrip())


def _add_timm(weights: Published, folder: Path, src: Path | None, revision: str | None) -> tuple[Path, Path]:
    if src is not None:
        if not Path(src).is_file():
            raise StageError(f"SRC {src}: no such file")
        path, revision = Path(src), None
    else:
        path, revision = timm_weights.download(str(weights.hub), revision)
    digest = sha256_file(path)
    dest = timm_weights.named_file(folder, weights.arch, weights.name, digest)
    record = _check_new(dest)
    _add_copy(path, dest)
    with edit_yaml(record) as document:  # `dvc add` keeps a .dvc file's meta when it adds again
        document["meta"] = {"hub": weights.hub, "file": timm_weights.HUB_FILE, "revision": revision or "unknown (SRC)",
                            "sha256": digest}  # fmt: skip
    return dest, record


def run(
    weights: Published, *, folder: Path, src: Path | None = None, url: str | None = None,
    params_file: Path = PARAMS_FILE, revision: str | None = None,
) -> Path:  # fmt: skip
    """Bring `weights`' file into `folder`, tracked by DVC; returns its path."""
    if weights.hub is not None:
        dest, record = _add_timm(weights, folder, src, revision)
        _done(weights, dest, record, folder, params_file)
        return dest
    dest = weights_file(folder, weights)
    record = _check_new(dest)
    if src is not None:
        if not Path(src).is_file():
            raise StageError(f"SRC {src}: no such file")
        _refuse_mismatch(Path(src), weights, f"SRC {src}")  # before anything is written
        _add_copy(Path(src), dest)
    else:
        source = url or weights.url
        folder.mkdir(parents=True, exist_ok=True)
        proc = _dvc("import-url", source, str(dest))
        if proc.returncode != 0:
            dest.unlink(missing_ok=True)
            raise StageError(
                f"dvc import-url {source} failed (no internet here? then SRC=/path/to/{weights.filename}):\n"
                f"{proc.stdout}{proc.stderr}".rstrip()
            )
        try:
            _refuse_mismatch(dest, weights, f"{source}")
        except StageError:
            _dvc("remove", "--outs", str(record))  # the .dvc file, its .gitignore entry and the file
            dest.unlink(missing_ok=True)
            raise
    _done(weights, dest, record, folder, params_file)
    return dest


def _done(weights: Published, dest: Path, record: Path, folder: Path, params_file: Path) -> None:
    set_params(params_file, [f"train.arch={weights.arch}", f"train.pretrained={weights.name}"])
    log.info("%s %s -> %s (its sha256 starts as its name says), tracked by DVC (%s); params.yaml train.arch = %s, "
             "train.pretrained = %s", weights.arch, weights.name, dest, record, weights.arch, weights.name)  # fmt: skip
    log.info("these weights were trained on %d px crops (preprocess.image_size: larger than 64 suits them, "
             "at a cost in speed)", weights.crop_size)  # fmt: skip
    log.info("to keep it: git add %s %s %s && git commit -m 'weights: %s %s' && dvc push", record,
             folder / ".gitignore", params_file, weights.arch, weights.name)  # fmt: skip


def _main(p: Params) -> None:
    parser = argparse.ArgumentParser(prog="python -m tasks.tools.add_weights", description=__doc__.splitlines()[0])
    parser.add_argument("arch", help="train.arch: a torchvision model's name, or timm/<name>")
    parser.add_argument("--weights", default="DEFAULT", help="torchvision's weights name (IMAGENET1K_V1, DEFAULT) or "
                        "timm's pretrained tag (e2400_r224_in1k, DEFAULT)")  # fmt: skip
    parser.add_argument("--revision", help="timm's: the hub commit to download (default: the newest)")
    parser.add_argument("--src", type=Path, help="a copy of the weights file you already have")
    parser.add_argument("--url", help="where to download it from, when not torchvision's own URL (a mirror)")
    args = parser.parse_args()
    build_model(args.arch, 2)  # a name that is no model: one line with the nearest names
    run(published(args.arch, args.weights), folder=p.paths.pretrained, src=args.src, url=args.url,
        revision=args.revision)  # fmt: skip


def main() -> None:
    stage_main("add-weights", _main)


if __name__ == "__main__":
    main()
