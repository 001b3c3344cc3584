"""The layout of the folders a user points `data.source` (and `data.test_source`) at -> the roots to read.

Two layouts are recognised, by the names of data.source's top-level folders:
- class folders, `root/<class>/<image>` (torchvision's ImageFolder): val and test are split off by content hash,
  or test is `data.test_source` when that is set;
- split folders, `root/<split>/<class>/<image>`, in any case, with the split names public datasets use
  (SPLIT_NAMES: train, training, training_set, seg_train; val, valid, validation; test, testing, test_set,
  seg_test): each folder is its split, a missing val or test is split off train by content hash.
A wrapper, a folder that holds exactly one folder and no images of its own, is descended into, at the top
(`dataset/train ...`) and inside a split folder (Kaggle's `training_set/training_set/<class>`), and named.
Beside split folders, a folder of images with no class folders (Intel scenes' `seg_pred`) is unlabelled:
ignored, with one warning. Anything else that mixes split names with other names is refused, and so are
would-be class folders that all hold only folders (the model would learn which folder an image came from).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.core.errors import StageError
from tasks.core.params import DataParams
from tasks.images.class_names import SPLIT_NAMES, is_class_folder
from tasks.images.imaging import is_image_name
from tasks.images.validation import SOURCE, TEST_SOURCE, VAL_SOURCE, class_folders, fixed_test_folder

log = logging.getLogger(__name__)

ROLE_OF_SPLIT = {"train": SOURCE, "val": VAL_SOURCE, "test": TEST_SOURCE}
EXPECTED = "root/<class>/<image>, or root/<split>/<class>/<image> with split folders train, val and test"


@dataclass(frozen=True)
class Layout:
    kind: str  # "class folders" or "split folders"
    source: Path  # data.source as given
    roots: tuple[tuple[str, Path], ...]  # (role, folder): SOURCE first, then VAL_SOURCE / TEST_SOURCE if fixed
    class_names: tuple[str, ...]
    why: str
    missing: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (split, classes with no folder there)
    wrappers: tuple[str, ...] = ()  # folders descended into (each held one folder and no images), under source
    unlabelled: tuple[str, ...] = ()  # folders of images without class folders beside the splits: ignored

    @property
    def fixed(self) -> frozenset[str]:
        """The splits a folder fixes (the others are split off the train folder by content hash)."""
        splits = {VAL_SOURCE: "val", TEST_SOURCE: "test"}
        return frozenset(splits[role] for role, _ in self.roots if role in splits)

    def folder(self, role: str) -> Path | None:
        return dict(self.roots).get(role)

    def split_roots(self) -> dict[str, Path]:
        """{split: the folder holding its class folders, below every wrapper} for the folders under `source`
        (a class-folders tree is all "train"; data.test_source, outside it, is not listed)."""
        split_of_role = {role: split for split, role in ROLE_OF_SPLIT.items()}
        return {split_of_role[role]: folder for role, folder in self.roots if folder.is_relative_to(self.source)}

    def missing_line(self) -> str | None:
        """One line naming the classes a val or test folder lacks (their scores there measure nothing)."""
        if not self.missing:
            return None
        parts = "; ".join(f"{split} has no folder for {', '.join(names)}" for split, names in self.missing)
        return f"{parts}: those classes are not measured on that split"

    def to_json(self) -> dict[str, Any]:
        """For the manifest: no machine's path in it (the same data gives the same bytes in any checkout)."""
        found = {
            "kind": self.kind,
            "why": self.why,
            "folders": {role: self._relative(folder) for role, folder in self.roots},
            "missing": {split: list(names) for split, names in self.missing},
        }
        found.update({key: list(value) for key, value in (("wrappers", self.wrappers), ("unlabelled", self.unlabelled))
                      if value})  # fmt: skip
        return found

    def _relative(self, folder: Path) -> str:
        if folder == self.source:
            return "data.source"
        if folder.is_relative_to(self.source):
            return f"data.source/{folder.relative_to(self.source).as_posix()}"
        return "data.test_source"


def _folders(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and is_class_folder(p.name))


def _has_images(folder: Path) -> bool:
    """Does `folder` hold an image file of its own (not in a subfolder)? Stops at the first."""
    return any(p.is_file() and is_image_name(p.name) for p in folder.iterdir())


def unwrap(folder: Path, descended: list[Path], *, top: bool = False, loose: bool = False) -> Path:
    """Below every wrapper: while `folder` holds exactly one folder and no images, go down; each step is added
    to `descended`. It stops above a folder of images (a class folder, unless `loose`: looking for loose
    images) and, at the `top`, above a lone split folder (root/train/<class> is a split, not a wrapper)."""
    while True:
        inner = _folders(folder)
        if len(inner) != 1 or _has_images(folder) or (not _folders(inner[0]) and not loose):
            return folder  # a lone folder with no folders in it is a class folder (if an empty one), no wrapper
        if (top and inner[0].name.lower() in SPLIT_NAMES) or (not loose and _has_images(inner[0])):
            return folder
        descended.append(inner[0])
        folder = inner[0]


def _refuse_folder_classes(root: Path, names: tuple[str, ...], *, what: str) -> None:
    """Would-be class folders that all hold only folders are splits or wrappers under other names, not classes."""
    if names and all(_folders(root / name) and not _has_images(root / name) for name in names):
        raise StageError(f"{what} {root}: its folders {', '.join(names)} hold only folders, no images of their own: "
                         "they look like splits or wrappers, not classes, and a model would learn which folder an "
                         f"image came from; point {what} at the folder that holds the class folders, or name the "
                         "splits train, val and test")  # fmt: skip


def split_folders(root: Path, *, what: str, unlabelled: list[Path] | None = None) -> dict[str, Path] | None:
    """{split: folder} when root's top-level folders are split names, None when none is. Beside them, a folder of
    images without class folders (below any wrapper) is added to `unlabelled`; any other mix is refused."""
    class_folders(root, what=what)  # the path errors (missing, a file, '~') first, each named
    names = [p.name for p in _folders(root)]
    splits = [name for name in names if name.lower() in SPLIT_NAMES]
    if not splits:
        return None
    others = []
    for name in (name for name in names if name.lower() not in SPLIT_NAMES):
        inner = unwrap(root / name, [], loose=True)
        if _has_images(inner) and not _folders(inner) and unlabelled is not None:
            unlabelled.append(root / name)
        else:
            others.append(name)
    if others:
        raise StageError(
            f"{what} {root}: its folders mix split names ({', '.join(splits)}) with other names "
            f"({', '.join(others)}); expected {EXPECTED}"
        )
    found: dict[str, Path] = {}
    for name in splits:
        split = SPLIT_NAMES[name.lower()]
        if split in found:
            raise StageError(f"{what} {root}: folders {found[split].name} and {name} are both the {split} split; "
                             "keep one")  # fmt: skip
        found[split] = root / name
    if "train" not in found:
        raise StageError(f"{what} {root}: split folders {', '.join(splits)} but no train folder; expected {EXPECTED}")
    return found


def _tops(
    source: Path, *, what: str, descended: list[Path], unlabelled: list[Path] | None = None
) -> tuple[Path, dict[str, Path] | None]:
    """Below the wrappers: the folder holding the class or split folders, and {split: the folder holding that
    split's class folders} (None for class folders). Each wrapper descended into is added to `descended`."""
    class_folders(source, what=what)  # the path errors (missing, a file, '~') first, each named
    top = unwrap(source, descended, top=True)
    splits = split_folders(top, what=what, unlabelled=unlabelled)
    if splits is None:
        return top, None
    return top, {split: unwrap(splits[split], descended) for split in ("train", "val", "test") if split in splits}


def incoming_folders(src: Path, *, what: str = "SRC") -> tuple[str, dict[str, Path]]:
    """Where the class folders of a folder of new images are (add-data INTO=, the review page's take-in), by the
    rules of read_layout: ("class folders", {"train": folder}) or ("split folders", {split: folder})."""
    top, splits = _tops(Path(src), what=what, descended=[])
    if splits is None:
        return "class folders", {"train": top}
    return "split folders", splits


def read_layout(source: Path, test_source: Path | None = None, *, what: str = "data.source") -> Layout:
    """The roots and classes of `source` (and of the fixed test folder `test_source`, if any); every way the
    folders can be unreadable as a layout is one StageError naming the folder and what was expected."""
    source = Path(source)
    descended: list[Path] = []
    unlabelled: list[Path] = []
    top, splits = _tops(source, what=what, descended=descended, unlabelled=unlabelled)
    if splits is None:
        class_names = class_folders(top, what=what, at_least=2)
        _refuse_folder_classes(top, class_names, what=what)
        roots: list[tuple[str, Path]] = [(SOURCE, top)]
        why = f"its top-level folders {_few(class_names)} are not split names, so they are the classes"
        per_split = {"train": class_names}
    else:
        per_split = {}
        for split, folder in splits.items():
            per_split[split] = class_folders(folder, what=f"{what} {split} folder", at_least=1)
            _refuse_folder_classes(folder, per_split[split], what=f"{what} {split} folder")
        class_names = tuple(sorted(set().union(*per_split.values())))
        roots = [(ROLE_OF_SPLIT[split], splits[split]) for split in ("train", "val", "test") if split in splits]
        named = ", ".join(f"{_under(splits[split], source)} ({split})" for split in ("train", "val", "test")
                          if split in splits)  # fmt: skip
        why = f"its top-level folders are split names: {named}, each holding class folders"
        if len(class_names) < 2:
            raise StageError(f"{what} {source}: its split folders hold {len(class_names)} class folder(s) "
                             f"{list(class_names)}, need at least 2; expected {EXPECTED}")  # fmt: skip
        only_elsewhere = sorted(set(class_names) - set(per_split["train"]))
        if only_elsewhere:
            elsewhere = "/".join(s for s in per_split if s != "train")
            raise StageError(f"{what} {splits['train']}: no folder for classes {only_elsewhere}, which {elsewhere} "
                             "has; every class needs training images")  # fmt: skip
    if test_source is not None:
        if splits is not None and "test" in splits:
            raise StageError(
                f"data.test_source {test_source}: {what} {source} has its own test folder ({splits['test'].name}); "
                "set data.test_source back to paths.generated or remove one of the two"
            )
        _check_test_folder(source, Path(test_source), class_names, what=what)
        roots.append((TEST_SOURCE, Path(test_source)))
        per_split["test"] = class_folders(Path(test_source), what="data.test_source")
    missing = tuple(
        (split, tuple(sorted(set(class_names) - set(per_split[split]))))
        for split in ("val", "test")
        if split in per_split and set(class_names) - set(per_split[split])
    )
    kind = "class folders" if splits is None else "split folders"
    wrappers = tuple(_under(folder, source) for folder in descended)
    if wrappers:
        why += f"; descended into {', '.join(wrappers)} (a folder holding one folder and no images)"
        log.info("%s %s: descended into %s: each held one folder and no images", what, source, ", ".join(wrappers))
    ignored = tuple(_under(folder, source) for folder in unlabelled)
    if ignored:
        why += f"; ignored {', '.join(ignored)}: images without class folders (unlabelled)"
        log.warning("%s %s: ignored %s beside the split folders: images without class folders, so without labels",
                    what, source, ", ".join(ignored))  # fmt: skip
    return Layout(kind, source, tuple(roots), class_names, why, missing, wrappers, ignored)


def _under(folder: Path, source: Path) -> str:
    return folder.relative_to(source).as_posix() if folder.is_relative_to(source) else str(folder)


def _few(names: tuple[str, ...], shown: int = 4) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"({', '.join(names[:shown])}{more})"


def _check_test_folder(source: Path, test_source: Path, class_names: tuple[str, ...], *, what: str) -> None:
    src, test = source.resolve(), test_source.resolve()
    if src == test or src in test.parents or test in src.parents:
        raise StageError(f"data.test_source {test_source} and {what} {source} overlap; use separate folders")
    extra = sorted(set(class_folders(test_source, what="data.test_source", at_least=1)) - set(class_names))
    if extra:
        raise StageError(
            f"data.test_source {test_source}: class folders {extra} are not classes of {what} {source} "
            f"({list(class_names)})"
        )


def data_layout(data: DataParams, generated: Path) -> Layout:
    """The layout params.yaml's data section names (data.test_source left at paths.generated is none)."""
    return read_layout(Path(data.source), fixed_test_folder(data, generated))


def check_data_folders(data: DataParams, generated: Path) -> None:
    """Preflight of the folders a user typed (data.source, data.test_source), before any stage works:
    DVC itself would only fail later, at the preprocess stage, with a bare `[Errno 2]`."""
    test_source = fixed_test_folder(data, generated)
    if Path(data.source).resolve() != Path(generated).resolve():
        read_layout(Path(data.source), test_source)
    elif test_source is not None:  # the default data is made by the generate stage, which this precedes
        class_folders(test_source, what="data.test_source", at_least=1)
