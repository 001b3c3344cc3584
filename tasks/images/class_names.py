"""A class name -> accepted, or one line naming the rule it breaks: the one definition of a valid class.

A class that exists (a class folder of the dataset, as tasks/images/layout.py reads it, or one the model knows)
is always valid, whatever its length or characters: the layout reads any folder name that is not hidden and not
a split name. A new class (typed on the review page) becomes a folder of the review folder and then of the
dataset, so its name must be one folder name that every system reads as a class.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from tasks.core.errors import StageError

# the folder names public datasets use for their splits (tasks/images/layout.py reads them as splits, not classes)
SPLIT_NAMES = {
    **dict.fromkeys(("train", "training", "training_set", "seg_train"), "train"),
    **dict.fromkeys(("val", "valid", "validation"), "val"),
    **dict.fromkeys(("test", "testing", "test_set", "seg_test"), "test"),
}
MAX_LENGTH = 255  # a folder name's limit on ext4, NTFS and APFS (iNaturalist's class names are 70-90 characters)
FORBIDDEN = re.compile(r'[\\/:*?"<>|\x00-\x1f\x7f]')  # not allowed in a folder name on every system
WINDOWS_RESERVED = {"con", "prn", "aux", "nul", *(f"com{i}" for i in range(1, 10)), *(f"lpt{i}" for i in range(1, 10))}


class InvalidClassName(StageError):
    """A new class name that cannot be a class folder (the review page answers it with 400)."""

    status = 400


def is_class_folder(name: str) -> bool:
    """Is a folder of this name a class to the layout (not hidden: hidden folders hold what is not a class)?"""
    return not name.startswith(".")


def check_class_name(name: str, known: Collection[str] = ()) -> str:
    """`name` when it is a class already (`known`) or can be a new class folder; else InvalidClassName naming the
    rule it breaks."""
    if name in known:
        return name
    if not name or not name.strip():
        raise InvalidClassName("class name is empty")
    if name != name.strip():
        raise InvalidClassName(f"class name {name!r} begins or ends with a space; remove it")
    if len(name.encode()) > MAX_LENGTH:
        raise InvalidClassName(f"class name {name[:20]!r}... is {len(name.encode())} bytes long: a folder name holds "
                               f"at most {MAX_LENGTH}")  # fmt: skip
    if name in (".", ".."):
        raise InvalidClassName(f"class name {name!r} is not a folder name")
    if "/" in name or "\\" in name:
        raise InvalidClassName(f"class name {name!r} is a path, not one folder name")
    found = FORBIDDEN.search(name)
    if found:
        raise InvalidClassName(f"class name {name!r} contains {found.group()!r}: not allowed in folder names")
    if not is_class_folder(name):
        raise InvalidClassName(f"class name {name!r} starts with '.': hidden folders are not read as classes")
    if name.split(".")[0].lower() in WINDOWS_RESERVED:
        raise InvalidClassName(f"class name {name!r} is a reserved device name on Windows")
    if name.lower() in SPLIT_NAMES:
        raise InvalidClassName(f"class name {name!r} is a split folder name, not a class")
    return name
