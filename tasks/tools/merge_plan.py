"""The plan of `make add-data SRC=new/ INTO=pets`, made before a byte is written: SRC's images -> what is added
(and to which split preprocess will put it), what is skipped, and every conflict refused in one line.

SRC's images (image names inside class folders, below any wrapper, as tasks.images.layout reads them; `.json`
sidecars and other files are ignored) are hashed against the dataset's: the same bytes already in the same
class are skipped and counted; the same bytes under another class, or a path that exists with other bytes,
refuse the merge (from the review folder, whose images are named by whoever saved them, such an image is
added as `<stem>-<sha256[:12]><ext>` instead). From the review folder only its images to review are read
(tasks.images.review_folder: `<class>/<image>`). Each added image's split is computed with preprocess's own
rule (tasks.images.splits.split_of).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePath
from typing import Any

from tasks.core.errors import StageError
from tasks.core.io import sha256_and_size
from tasks.core.params import Params
from tasks.images.layout import Layout, incoming_folders, read_layout
from tasks.images.review_folder import is_review_image
from tasks.images.shards import SPLITS
from tasks.images.splits import split_of
from tasks.images.validation import class_folders, discover, fixed_test_folder

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

    def record(
        self, rule: dict[str, Any], from_review: bool, decisions: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The meta.merges entry: counts and the added images' sha256, sorted (no paths, no times: the same merge
        writes the same bytes anywhere; preprocess lays the shards out by them, tasks/images/history.py);
        `decisions` (the review page's take-in): how many entries its decision log held and that prefix's sha256."""
        found = {
            "added": len(self.add),
            "images": sorted(image.sha256 for image, _ in self.add),
            "skipped": len(self.skipped),
            "classes": self.per_class(),
            "splits": self.split_counts(),
            "classes_new": list(self.classes_new),
            "split_rule": rule,
            "from_review": from_review,
        }
        if decisions is not None:
            found["decisions"] = decisions
        return found

    def per_class(self) -> dict[str, dict[str, int]]:
        added, skipped = Counter(i.cls for i, _ in self.add), Counter(i.cls for i in self.skipped)
        return {c: {"added": added[c], "skipped": skipped[c]} for c in sorted(set(added) | set(skipped))}

    def split_counts(self) -> dict[str, int]:
        counts = Counter(split for _, split in self.add)
        return {split: counts[split] for split in SPLITS}


def folder_pairs(src: Path, dest: Path, *, what: str) -> tuple[Layout, list[tuple[str, Path, Path]]]:
    """The dataset's layout and (split, SRC folder, dataset folder) for each folder of SRC, both below their
    wrappers as preprocess reads them (tasks.images.layout).

    Class folders go to a class-folders dataset, or to the train folder of a split one (its val and test
    folders are fixed sets the user chose; preprocess splits val or test off train by hash where it has
    no such folder). SRC's own split folders go to the dataset's folders of the same splits."""
    layout = read_layout(dest, what=what)
    dest_roots = layout.split_roots()
    src_kind, src_roots = incoming_folders(src, what="SRC")  # a missing SRC or a mix of names: one line, here
    if src_kind == "class folders":
        class_folders(src_roots["train"], what="SRC", at_least=1)
        return layout, [("train", src_roots["train"], dest_roots["train"])]
    if layout.kind == "class folders":
        raise StageError(f"SRC {src}: split folders ({', '.join(sorted(p.name for p in src_roots.values()))}), "
                         f"but {dest} holds class folders, whose val and test preprocess splits off by hash; "
                         "give SRC as class folders (SRC/<class>/<image>)")  # fmt: skip
    for split, folder in src_roots.items():
        if split not in dest_roots:
            raise StageError(f"SRC {folder}: {dest} has no {split} folder, and a new one would move images that "
                             f"preprocess now splits off train by hash; put these class folders in SRC/"
                             f"{src_roots['train'].relative_to(src).as_posix()}")  # fmt: skip
    return layout, [(split, src_roots[split], dest_roots[split]) for split in SPLITS if split in src_roots]


def split_rule(params: Params, layout: Layout, dest: Path) -> dict[str, Any]:
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
    # preprocess's own function; the test of this module runs preprocess on the merged folder and compares
    # every added file's split.
    return split_of(sha256, rule["seed"], rule["val_fraction"], rule["test_fraction"],
                    fixed=frozenset(rule["fixed"]))  # fmt: skip


def _incoming(
    src: Path, dest: Path, pairs: list[tuple[str, Path, Path]], from_review: bool
) -> tuple[list[Incoming], int]:
    images: list[Incoming] = []
    ignored = 0
    for split, folder, target in pairs:
        names = class_folders(folder, what="SRC", at_least=0)
        candidates, _, skipped = discover(folder, role=split, class_names=names)
        ignored += len(skipped)
        for item in candidates:
            if from_review and not is_review_image(PurePath(item.path)):
                ignored += 1  # deeper than <class>/<image>: not a review image, left there
                continue
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


def plan_merge(src: Path, dest: Path, layout: Layout, pairs: list[tuple[str, Path, Path]], rule: dict[str, Any],
               from_review: bool = False) -> MergePlan:  # fmt: skip
    images, ignored = _incoming(src, dest, pairs, from_review)
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
        if os.path.lexists(target) and from_review:  # another image of that name: named by its bytes too
            path = PurePath(image.rel)
            image = replace(image, rel=path.with_name(f"{path.stem}-{image.sha256[:12]}{path.suffix}").as_posix())
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
