"""A class name typed on the review page -> accepted, or one line naming the rule it breaks.

A class is a folder of the review folder and, after the take-in, of the dataset: its name must be one folder
name that every system and tasks/images/layout.py read as a class (not hidden, not a split name).
"""

from __future__ import annotations

import re

from tasks.images.layout import SPLIT_NAMES
from tasks.tools.review.refusals import BadInput

MAX_LENGTH = 64  # as add-data's dataset names (tasks/tools/add_data.py NAME_RULE)
FORBIDDEN = re.compile(r'[\\/:*?"<>|\x00-\x1f\x7f]')  # not allowed in a folder name on every system
WINDOWS_RESERVED = {"con", "prn", "aux", "nul", *(f"com{i}" for i in range(1, 10)), *(f"lpt{i}" for i in range(1, 10))}


class InvalidClassName(BadInput):
    """A class name that cannot be a class folder."""


def check_class_name(name: str) -> str:
    """`name` when it can be a class folder; else InvalidClassName naming the rule."""
    if not name or not name.strip():
        raise InvalidClassName("class name is empty")
    if name != name.strip():
        raise InvalidClassName(f"class name {name!r} begins or ends with a space; remove it")
    if len(name) > MAX_LENGTH:
        raise InvalidClassName(f"class name {name[:20]!r}... is {len(name)} characters long: at most {MAX_LENGTH}")
    if name in (".", ".."):
        raise InvalidClassName(f"class name {name!r} is not a folder name")
    if "/" in name or "\\" in name:
        raise InvalidClassName(f"class name {name!r} is a path, not one folder name")
    found = FORBIDDEN.search(name)
    if found:
        raise InvalidClassName(f"class name {name!r} contains {found.group()!r}: not allowed in folder names")
    if name.startswith("."):
        raise InvalidClassName(f"class name {name!r} starts with '.': hidden folders are not read as classes")
    if name.split(".")[0].lower() in WINDOWS_RESERVED:
        raise InvalidClassName(f"class name {name!r} is a reserved device name on Windows")
    if name.lower() in SPLIT_NAMES:
        raise InvalidClassName(f"class name {name!r} is a split folder name, not a class")
    return name
