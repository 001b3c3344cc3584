"""`make add-data SRC=new/ INTO=pets`: new images merged into the DVC-tracked data/raw/pets -> a new version of it.

The whole merge is planned first (tasks.tools.merge_plan). Then the images are copied into a staging folder
inside data/raw, moved in and `dvc add`ed; a failed move or `dvc add` takes out what was moved and puts the .dvc
file back. params.yaml is not changed. The merge's counts and its images' sha256 are appended to the .dvc file's
`meta.merges` (no paths, no times): preprocess puts those images in shards of their own. When SRC is the server's
review folder (params serve.review_dir), what was taken (images and their sidecars) then leaves it; any other SRC
is only read.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from tasks.core.errors import StageError
from tasks.core.params import Params
from tasks.core.private_api import edit_yaml
from tasks.images.class_names import is_class_folder
from tasks.tools.merge_plan import MergePlan, folder_pairs, plan_merge, split_rule

log = logging.getLogger(__name__)
SHA256_NAME = re.compile(r"[0-9a-f]{64}")  # the review folder's file names: <sha256>.<ext>


def merge(src: Path, name: str, dest: Path, *, params: Params, decisions: dict[str, Any] | None = None,
          from_review: bool | None = None) -> MergePlan:  # fmt: skip
    """Merge `src` into the DVC-tracked dataset `dest` (data/raw/<name>); returns what was done. `decisions`: the
    review page's log as the merge took it in (entries, sha256), recorded with the merge so the two stay tied.
    `from_review`: SRC is review images (the page's staging folder inside the review folder); None: SRC is
    the review folder itself."""
    src, dvc_file = Path(src), dest.with_name(f"{name}.dvc")
    check_dataset(src, name, dest, dvc_file)
    layout, pairs = folder_pairs(src, dest, what=f"INTO {name}")
    rule = split_rule(params, layout, dest)
    if from_review is None:
        from_review = src.resolve() == Path(params.serve.review_dir).resolve()
    plan = plan_merge(src, dest, layout, pairs, rule, from_review)
    check_dataset_is_committed(name, dest, dvc_file)
    if plan.add:
        _apply(plan, dest, dvc_file)
        with edit_yaml(dvc_file) as document:  # `dvc add` keeps a .dvc file's meta when it adds again
            meta = document.get("meta") or {}
            meta.setdefault("merges", []).append(plan.record(rule, from_review, decisions))
            document["meta"] = meta
    _log(plan, src, dest, dvc_file, params, rule)
    if from_review:  # the skipped ones too: their bytes are in the dataset already
        taken = [image.src for image, _ in plan.add] + [image.src for image in plan.skipped]
        sidecars = _empty_review(src, taken)
        log.info("review folder %s: %d image(s) and %d sidecar(s) taken out; the rest stays", src, len(taken),
                 sidecars)  # fmt: skip
    return plan


def check_dataset(src: Path, name: str, dest: Path, dvc_file: Path) -> None:
    """The dataset `name` that SRC grows is here, DVC-tracked, and neither holds nor sits inside SRC (make
    add-data INTO=, and the review page's take-in before it plans anything)."""
    if not dest.is_dir():
        if dvc_file.is_file():
            raise StageError(f"INTO {name}: {dest} is not here though {dvc_file} tracks it; "
                             f"`dvc pull {dvc_file}` brings its images, then merge")  # fmt: skip
        raise StageError(f"INTO {name}: no dataset {dest}; `make add-data SRC={src} NAME={name}` makes a new one")
    if not dvc_file.is_file():
        raise StageError(f"INTO {name}: {dest} is not tracked by DVC (no {dvc_file}); `dvc add {dest}` it first, "
                         "or bring SRC in as a new dataset with NAME=")  # fmt: skip
    source, target = src.resolve(), dest.resolve()
    if source == target or source in target.parents:
        raise StageError(f"SRC {src}: contains {dest}; bring in a folder outside data/raw/")
    if target in source.parents:
        raise StageError(f"SRC {src}: inside {dest}, the dataset it would grow; bring in a folder outside it")


def check_dataset_is_committed(name: str, dest: Path, dvc_file: Path) -> None:
    """`dvc add` would take any change already in the folder along with the merge: refused, so the previous
    version is exactly what the .dvc file names."""
    proc = subprocess.run([sys.executable, "-m", "dvc", "status", "--json", str(dvc_file)], capture_output=True,
                          text=True)  # fmt: skip
    try:
        status = json.loads(proc.stdout or "{}") if proc.returncode == 0 else None
    except json.JSONDecodeError:
        status = None
    if status is None:
        raise StageError(f"dvc status {dvc_file} failed, nothing was added:\n{proc.stdout}{proc.stderr}".rstrip())
    if status:
        raise StageError(f"INTO {name}: {dest} differs from {dvc_file} (`dvc status {dvc_file}`); `dvc add {dest}` "
                         f"to keep that change, or `dvc checkout {dvc_file}` to drop it, then merge")  # fmt: skip


def _apply(plan: MergePlan, dest: Path, dvc_file: Path) -> None:
    """Copy into a staging folder beside the dataset (a crash mid-copy leaves nothing inside it), move in,
    `dvc add`; on any failure the moved files and made folders go, and the .dvc file is put back."""
    staging = dest.with_name(f".{dest.name}.merge-{os.getpid()}")
    before = dvc_file.read_bytes()
    moved: list[Path] = []
    made: list[Path] = []
    try:
        for image, _ in plan.add:
            staged = staging / image.rel
            staged.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(image.src, staged)
        for image, _ in plan.add:
            target = dest / image.rel
            for folder in reversed(target.parents):
                if dest in folder.parents and not folder.exists():
                    folder.mkdir()
                    made.append(folder)
            if os.path.lexists(target):
                raise StageError(f"{target}: appeared while add-data ran; nothing was added")
            os.replace(staging / image.rel, target)
            moved.append(target)
        proc = subprocess.run([sys.executable, "-m", "dvc", "add", str(dest)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise StageError(f"dvc add {dest} failed, nothing was added:\n{proc.stdout}{proc.stderr}".rstrip())
    except BaseException:
        for path in moved:
            path.unlink(missing_ok=True)
        for folder in reversed(made):
            shutil.rmtree(folder, ignore_errors=True)
        dvc_file.write_bytes(before)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _empty_review(review: Path, taken: list[Path]) -> int:
    """Remove the taken images and their sidecars (beside the image, or anywhere in the review folder for a
    `<sha256>` name: a relabel may have moved the image alone); folders this empties go too. Returns the
    number of sidecars removed."""
    hashed = {p.stem for p in taken if SHA256_NAME.fullmatch(p.stem)}
    sidecars = {p.with_suffix(".json") for p in taken if p.with_suffix(".json").is_file()}
    # a sidecar in a hidden folder (the review page's .discarded/) belongs to an image that stays there
    sidecars |= {p for p in review.rglob("*.json") if p.stem in hashed and p.is_file()
                 and all(is_class_folder(part) for part in p.relative_to(review).parts[:-1])}  # fmt: skip
    for path in [*taken, *sidecars]:
        path.unlink(missing_ok=True)
    review = review.resolve()
    for folder in sorted({p.parent.resolve() for p in [*taken, *sidecars]}, key=lambda p: len(p.parts), reverse=True):
        while folder != review and review in folder.parents and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent
    return len(sidecars)


def _log(plan: MergePlan, src: Path, dest: Path, dvc_file: Path, params: Params, rule: dict[str, Any]) -> None:
    ignored = f", {plan.ignored} ignored (not images in class folders: sidecars, other or hidden files; left there)"
    log.info("%s -> %s: %d added, %d skipped (their bytes are already there, in the same class)%s",
             src, dest, len(plan.add), len(plan.skipped), ignored if plan.ignored else "")  # fmt: skip
    for cls, counts in plan.per_class().items():
        log.info("  %s: %d added, %d skipped", cls, counts["added"], counts["skipped"])
    if not plan.add:
        log.info("nothing new: %s and %s are unchanged", dest, dvc_file)
        return
    splits = ", ".join(f"{split} {n}" for split, n in plan.split_counts().items())
    fixed = f"; fixed folders: {', '.join(rule['fixed'])}" if rule["fixed"] else ""
    log.info("the added images' splits: %s (preprocess's rule: sha256 and seed %d, val %g, test %g%s); old images "
             "keep theirs", splits, rule["seed"], rule["val_fraction"], rule["test_fraction"], fixed)  # fmt: skip
    if plan.classes_new:
        log.warning("new class folder(s) %s in %s: the gate will see the classes changed; `make promote` a model "
                    "of this data once it is good", plan.classes_new, dest)  # fmt: skip
    log.info("%s: a new version of %s, this merge recorded in its meta.merges; params.yaml unchanged (data.source "
             "is %s)", dvc_file, dest, params.data.source)  # fmt: skip
    log.info("to keep it: git add %s && git commit -m 'data: %s +%d images' && dvc push", dvc_file, dest.name,
             len(plan.add))  # fmt: skip
