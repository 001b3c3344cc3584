"""The review folder's one definition of an image to review, read by the server's count (serving/review_store.py),
the review page (tasks/tools/review/) and the take-in's merge (tasks/tools/data_merge.py).

An image to review is `<review_dir>/<class>/<image>`: a class folder as the layout reads one (not hidden), an
image file directly in it (not hidden: a writer's temporary file). A hidden top folder (the page's .discarded/,
a take-in's staging folder) holds what is decided: no count, page or merge takes it. Deeper folders are not read.

An image's id is the sha256 of its bytes (the server and `make review-label-errors` name files by it; a file put
there by hand may have any name, and `cat/IMG_1.jpg` and `dog/IMG_1.jpg` are two images). Its sidecar is
`<stem>.json` when that records the image's sha256, or records none and no other image of the folder has that stem.
"""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePath
from typing import Any

from tasks.core.io import sha256_file
from tasks.images.class_names import is_class_folder
from tasks.images.imaging import is_image_name

_IDS: dict[tuple[str, int, int, int], str] = {}  # (path, inode, size, mtime) -> sha256: a listing hashes new files only


def is_review_image(rel: PurePath) -> bool:
    """Is this path, relative to the review folder, an image to review?"""
    parts = rel.parts
    return len(parts) == 2 and is_class_folder(parts[0]) and is_class_folder(parts[1]) and is_image_name(parts[1])


def class_folders(root: Path) -> list[str]:
    try:
        return sorted(p.name for p in root.iterdir() if p.is_dir() and is_class_folder(p.name))
    except OSError:  # no review folder yet, or gone meanwhile
        return []


def images_in(folder: Path) -> list[Path]:
    """The images to review in one class folder, by name."""
    try:
        return sorted(p for p in folder.iterdir() if is_review_image(PurePath(folder.name, p.name)) and p.is_file())
    except OSError:
        return []


def review_images(root: Path) -> list[Path]:
    return [image for folder in class_folders(root) for image in images_in(root / folder)]


def count(root: Path) -> int:
    return len(review_images(root))


def image_id(image: Path) -> str:
    """The sha256 of the image's bytes, hashed once per file version."""
    st = image.stat()
    key = (str(image), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _IDS:
        if len(_IDS) > 100_000:
            _IDS.clear()
        _IDS[key] = sha256_file(image)
    return _IDS[key]


def owns_sidecar(image: Path, sha256: str) -> bool:
    """Is `<stem>.json` this image's sidecar (see the module's docstring)?"""
    record = read_sidecar(image.with_suffix(".json"))
    if record is None:
        return False
    if isinstance(record.get("sha256"), str):
        return record["sha256"] == sha256
    try:
        same_stem = [n for n in os.listdir(image.parent) if PurePath(n).stem == image.stem and is_image_name(n)]
    except OSError:
        return False
    return len(same_stem) == 1


def read_sidecar(path: Path) -> dict[str, Any] | None:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def sidecar_of(image: Path, sha256: str) -> dict[str, Any]:
    """The image's sidecar, or {} when it has none (put there by hand, or the sidecar is another image's)."""
    return (read_sidecar(image.with_suffix(".json")) or {}) if owns_sidecar(image, sha256) else {}
