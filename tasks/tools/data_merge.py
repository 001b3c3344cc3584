"""`make add-data SRC=new/ INTO=pets`: new images merged into the DVC-tracked data/raw/pets -> a new version of it.

The whole merge is planned before a byte is written. SRC's images (image names inside class folders; `.json`
sidecars and other files are ignored) are hashed against the dataset's: the same bytes already in the same
class are skipped and counted; the same bytes under another class, or a path that exists with other bytes,
refuse the merge in one line. Then the images are copied into a staging folder inside data/raw, moved in and
`dvc add`ed; a failed move or `dvc add` takes out what was moved and puts the .dvc file back. params.yaml is
not changed. Each added image's split is computed with preprocess's own rule (tasks.images.splits.split_of),
and the merge's counts are appended to the .dvc file's `meta.merges` (no paths, no times). When SRC is the
server's review folder (params serve.review_dir), what was taken (images and their sidecars) then leaves it;
any other SRC is only read.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.core.errors import StageError
from tasks.core.io import sha256_and_size
from tasks.core.params import Params, derive_seed
from tasks.core.private_api import edit_yaml
from tasks.images.layout import Layout, read_layout, split_folders
from tasks.images.shards import SPLITS
from tasks.images.splits import split_of
from tasks.images.validation import class_folders, discover, fixed_test_folder

log = logging.getLogger(__name__)
SHA256_NAME = re.compile(r"[0-9a-f]{64}")  # the review folder's file names: <sha256>.<ext>
FIRST = {"test": 0, "val": 1, "train": 2}  # of copies in several split folders, preprocess keeps test's, then val's


@dataclass(frozen=True)
class Incoming:
    """One image of SRC: where it is, where it goes under the dataset, its class and its bytes' sha256."""

    src: Path
    rel: str  # POSIX path under the dataset folder
    cls: str
    folder_split: str  # the dataset split folder it goes to ("train" for a class-folders dataset)
    sha256: str


@dataclass
class MergePlan:
    add: list[tuple[Incoming, str]] = field(default_factory=list)  # (image, the split preprocess will give it)
    skipped: list[Incoming] = field(default_factory=list)  # same bytes already there, same class
    ignored: int = 0  # files of SRC that are no images in class folders (sidecars, hidden, loose files)
    classes_new: list[str] = field(default_factory=list)

    def record(self, rule: dict[str, Any], from_review: bool) -> dict[str, Any]:
        """The meta.merges entry: counts only, so the same merge writes the same bytes anywhere."""
        return {
            "added": len(self.add),
            "skipped": len(self.skipped),
            "classes": self.per_class(),
            "splits": self.split_counts(),
            "classes_new": list(self.classes_new),
            "split_rule": rule,
            "from_review": from_review,
        }

    def per_class(self) -> dict[str, dict[str, int]]:
        added, skipped = Counter(i.cls for i, _ in self.add), Counter(i.cls for i in self.skipped)
        return {c: {"added": added[c], "skipped": skipped[c]} for c in sorted(set(added) | set(skipped))}

    def split_counts(self) -> dict[str, int]:
        counts = Counter(split for _, split in self.add)
        return {split: counts[split] for split in SPLITS}


def merge(src: Path, name: str, dest: Path, *, params: Params) -> MergePlan:
    """Merge `src` into the DVC-tracked dataset `dest` (data/raw/<name>); returns what was done."""
    src, dvc_file = Path(src), dest.with_name(f"{name}.dvc")
    _check_dataset(src, name, dest, dvc_file)
    layout, pairs = _pairs(src, dest, what=f"INTO {name}")
    rule = _split_rule(params, layout, dest)
    plan = _plan(src, dest, layout, pairs, rule)
    _check_dataset_is_committed(name, dest, dvc_file)
    from_review = src.resolve() == Path(params.serve.review_dir).resolve()
    if plan.add:
        _apply(plan, dest, dvc_file)
        with edit_yaml(dvc_file) as document:  # `dvc add` keeps a .dvc file's meta when it adds again
            meta = document.get("meta") or {}
            meta.setdefault("merges", []).append(plan.record(rule, from_review))
            document["meta"] = meta
    _log(plan, src, dest, dvc_file, params, rule)
    if from_review:  # the skipped ones too: their bytes are in the dataset already
        taken = [image.src for image, _ in plan.add] + [image.src for image in plan.skipped]
        sidecars = _empty_review(src, taken)
        log.info("review folder %s: %d image(s) and %d sidecar(s) taken out; the rest stays", src, len(taken),
                 sidecars)  # fmt: skip
    return plan


def _check_dataset(src: Path, name: str, dest: Path, dvc_file: Path) -> None:
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


def _check_dataset_is_committed(name: str, dest: Path, dvc_file: Path) -> None:
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


def _pairs(src: Path, dest: Path, *, what: str) -> tuple[Layout, list[tuple[str, Path, Path]]]:
    """The dataset's layout and (split, SRC folder, dataset folder) for each folder of SRC.

    Class folders go to a class-folders dataset, or to the train folder of a split one (its val and test
    folders are fixed sets the user chose; preprocess splits val or test off train by hash where it has
    no such folder). SRC's own split folders go to the dataset's folders of the same splits."""
    layout = read_layout(dest, what=what)
    dest_splits = split_folders(dest, what=what)
    src_splits = split_folders(src, what="SRC")  # a missing SRC or a mix of names: one line, here
    if src_splits is None:
        class_folders(src, what="SRC", at_least=1)
        return layout, [("train", src, dest if dest_splits is None else dest_splits["train"])]
    if dest_splits is None:
        raise StageError(f"SRC {src}: split folders ({', '.join(sorted(p.name for p in src_splits.values()))}), "
                         f"but {dest} holds class folders, whose val and test preprocess splits off by hash; "
                         "give SRC as class folders (SRC/<class>/<image>)")  # fmt: skip
    for split, folder in src_splits.items():
        if split not in dest_splits:
            raise StageError(f"SRC {folder}: {dest} has no {split} folder, and a new one would move images that "
                             f"preprocess now splits off train by hash; put these class folders in SRC/"
                             f"{src_splits['train'].name}")  # fmt: skip
    return layout, [(split, src_splits[split], dest_splits[split]) for split in SPLITS if split in src_splits]


def _split_rule(params: Params, layout: Layout, dest: Path) -> dict[str, Any]:
    """preprocess's split inputs for this dataset, as data.source: the seed, the fractions, the fixed folders."""
    fixed = set(layout.fixed)
    if Path(params.data.source).resolve() == dest.resolve() and fixed_test_folder(params.data, params.paths.generated):
        fixed.add("test")
    return {
        "seed": params.seed,
        "val_fraction": params.preprocess.val_fraction,
        "test_fraction": params.preprocess.test_fraction,
        "fixed": sorted(fixed),
    }


def _split(sha256: str, folder_split: str, rule: dict[str, Any]) -> str:
    if folder_split != "train":  # a val or test folder is its split
        return folder_split
    # The seed preprocess.run derives (derive_seed(seed, "preprocess")) and its function; the test of this
    # module runs preprocess on the merged folder and compares every added file's split.
    return split_of(sha256, derive_seed(rule["seed"], "preprocess"), rule["val_fraction"], rule["test_fraction"],
                    fixed=frozenset(rule["fixed"]))  # fmt: skip


def _incoming(src: Path, dest: Path, pairs: list[tuple[str, Path, Path]]) -> tuple[list[Incoming], int]:
    images: list[Incoming] = []
    ignored = 0
    for split, folder, target in pairs:
        names = class_folders(folder, what="SRC", at_least=0)
        candidates, _, skipped = discover(folder, role=split, class_names=names)
        ignored += len(skipped)
        for item in candidates:
            path = folder / item.path
            try:
                digest, _ = sha256_and_size(path)
            except OSError as exc:
                why = exc.strerror or exc
                raise StageError(f"SRC file {path}: cannot be read ({why}); nothing was added") from None
            rel = (target / item.path).relative_to(dest).as_posix()
            images.append(Incoming(path, rel, names[item.label], split, digest))
    if not images:
        raise StageError(f"SRC {src}: no images in its class folders (SRC/<class>/<image>); nothing to add")
    return images, ignored


def _dataset_hashes(dest: Path, layout: Layout, sizes: set[int]) -> dict[str, list[tuple[Path, str]]]:
    """{sha256: [(file, class)]} of the dataset's images whose size an incoming image has (no other can match)."""
    found: dict[str, list[tuple[Path, str]]] = {}
    for role, folder in layout.roots:
        names = class_folders(folder, what=f"{dest}", at_least=0)
        candidates, stats, _ = discover(folder, role=role, class_names=names)
        for item, stat in zip(candidates, stats, strict=True):
            if stat.error or stat.size not in sizes:
                continue
            path = folder / item.path
            try:
                digest, _ = sha256_and_size(path)
            except OSError:  # preprocess quarantines it as unreadable; it matches nothing here
                continue
            found.setdefault(digest, []).append((path, names[item.label]))
    return found


def _plan(
    src: Path, dest: Path, layout: Layout, pairs: list[tuple[str, Path, Path]], rule: dict[str, Any]
) -> MergePlan:
    images, ignored = _incoming(src, dest, pairs)
    there = _dataset_hashes(dest, layout, {(i.src.stat().st_size) for i in images})
    plan = MergePlan(ignored=ignored)
    taken: dict[str, Incoming] = {}
    for image in sorted(images, key=lambda i: (FIRST[i.folder_split], i.rel)):  # as preprocess keeps copies
        copies = there.get(image.sha256, [])
        if copies:
            if any(cls == image.cls for _, cls in copies):
                plan.skipped.append(image)
                continue
            other, cls = copies[0]
            raise StageError(f"SRC file {image.src} (class {image.cls}) has the same bytes as {other} (class {cls}): "
                             "one image cannot have two labels; delete it or move it into the class it has there, "
                             "nothing was added")  # fmt: skip
        first = taken.get(image.sha256)
        if first is not None:
            if first.cls == image.cls:
                plan.skipped.append(image)
                continue
            raise StageError(f"SRC file {image.src} (class {image.cls}) has the same bytes as {first.src} "
                             f"(class {first.cls}): one image cannot have two labels; keep one, nothing was "
                             "added")  # fmt: skip
        target = dest / image.rel
        if os.path.lexists(target):  # same bytes in the same class were skipped above: these bytes differ
            raise StageError(f"SRC file {image.src} would overwrite {target}, which holds other bytes; rename one of "
                             "them, nothing was added")  # fmt: skip
        taken[image.sha256] = image
        plan.add.append((image, _split(image.sha256, image.folder_split, rule)))
    _check_classes(dest, layout, plan)
    return plan


def _check_classes(dest: Path, layout: Layout, plan: MergePlan) -> None:
    """New classes are named (the caller warns); one that would have no train folder is refused, as preprocess
    would refuse the dataset."""
    added = {image.cls for image, _ in plan.add}
    plan.classes_new = sorted(added - set(layout.class_names))
    if layout.kind != "split folders":
        return
    train = set(class_folders(layout.roots[0][1], what=str(dest), at_least=0))
    train |= {image.cls for image, _ in plan.add if image.folder_split == "train"}
    for image, split in plan.add:
        if image.cls not in train:
            raise StageError(f"SRC file {image.src}: class {image.cls} would be in {dest}'s {split} folder but not "
                             "in its train folder; every class needs training images, nothing was added")  # fmt: skip


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
    sidecars |= {p for p in review.rglob("*.json") if p.stem in hashed and p.is_file()}
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
