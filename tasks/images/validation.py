"""An ImageFolder on disk -> candidate images, ignored files, and per-file hash and decode results.

`discover` walks a root (root/<class>/.../<file>) and sorts every file it finds into candidates
(image names inside a class folder, with their sizes) and ignored files (hidden, not an image by
name, outside a class folder, not a regular file). `hash_file` (threads, pass 1) and `check_file`
(worker processes, tasks.images.workpool) turn any bad data into a result with a reason code, never an
exception.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from tasks.core.errors import StageError
from tasks.core.io import sha256_and_size, sha256_bytes
from tasks.core.params import DataParams
from tasks.images.class_names import is_class_folder
from tasks.images.imaging import (
    EXIF_ORIENTATION,
    TRANSPOSED,
    ImageError,
    PreprocessSpec,
    decode_sized,
    is_image_name,
    to_square,
)

SOURCE, VAL_SOURCE, TEST_SOURCE = "source", "val_source", "test_source"


@dataclass(frozen=True)
class Candidate:
    """An image-named file inside a class folder; `path` is "<class>/.../<file>" under its root."""

    root: str  # SOURCE, VAL_SOURCE or TEST_SOURCE (tasks.images.layout)
    path: str
    label: int

    def where(self) -> dict[str, str]:
        return {"root": self.root, "path": self.path}


@dataclass(frozen=True)
class Hashed:
    digest: str  # "" when not hashed yet: a file whose size no other file has (the decode pass hashes it)
    size: int
    error: str = ""  # why the file could not be read, if it could not


@dataclass(frozen=True)
class Checked:
    digest: str
    array: np.ndarray | None  # uint8 (3, S, S) when accepted
    reason: str = ""
    detail: str = ""
    size: int = -1  # bytes read
    shape: tuple[int, int] = (0, 0)  # (width, height) the file declares, EXIF orientation applied


@dataclass(frozen=True)
class CheckConfig:
    roots: tuple[tuple[str, Path], ...]  # (root name, folder) pairs
    spec: PreprocessSpec
    max_pixels: int
    min_side: int


def class_folders(root: Path, *, what: str, at_least: int = 0) -> tuple[str, ...]:
    """The class names of an ImageFolder: its visible subfolders (symlinks followed), sorted. Every
    way a typed path can be wrong is a StageError that names the key, the path and the fix."""
    if str(root).startswith("~"):
        # DVC tracks this path as a dependency and reads it literally (./~/...): expanding it here
        # would train on one folder while DVC hashes another.
        raise StageError(f"{what} {root}: '~' is not expanded by DVC; write the full path: {root.expanduser()}")
    if not root.exists():
        where = "" if root.is_absolute() else f" (relative to {Path.cwd()})"
        raise StageError(f"{what} {root}: no such folder{where}; expected an ImageFolder root/<class>/<image>")
    if not root.is_dir():
        raise StageError(f"{what} {root}: a file, not a folder; expected an ImageFolder root/<class>/<image>")
    names = tuple(sorted(p.name for p in root.iterdir() if p.is_dir() and is_class_folder(p.name)))
    if len(names) < at_least:
        loose = sum(1 for p in root.iterdir() if p.is_file() and is_image_name(p.name))
        found = f"found {len(names)} class folder(s){f' {list(names)}' if names else ''}"
        hint = f"; its {loose} image file(s) outside any class folder are ignored" if loose else ""
        raise StageError(
            f"{what} {root}: {found}, need at least {at_least} (one subfolder per class: root/<class>/<image>){hint}"
        )
    return names


def fixed_test_folder(data: DataParams, generated: Path) -> Path | None:
    """data.test_source, or None while it is left at paths.generated (the 'no test folder' value)."""
    return None if Path(data.test_source).resolve() == Path(generated).resolve() else Path(data.test_source)


def unversioned_source(data: DataParams, generated: Path, repo: Path = Path()) -> str | None:
    """A warning when data.source is a folder DVC hashes but does not store: outside the repository, or
    inside it but not `dvc add`ed (no <folder>.dvc beside it or beside a folder above it)."""
    source, root = Path(data.source).resolve(), repo.resolve()
    if source == Path(generated).resolve():
        return None  # the generate stage's output: cached and pushed like every output
    inside = source == root or root in source.parents
    folders = [source, *(p for p in source.parents if p == root or root in p.parents)]
    if inside and any(f.with_name(f.name + ".dvc").is_file() for f in folders if f != root):
        return None
    return (
        f"data.source {data.source} is not versioned: DVC hashes it as a dependency but does not store it, so once "
        f"the folder changes no commit can rebuild its model; `make add-data SRC={data.source} NAME=<name>` "
        "copies it under data/raw/ and tracks it"
    )


def _walk_files(root: Path) -> list[tuple[str, os.DirEntry[str]]]:
    """Every file under root as (relative POSIX path, its DirEntry), sorted by path; symlinked
    folders followed once (no cycles). os.scandir: file types come from the directory listing, so
    a plain file costs no stat call here."""
    found: list[tuple[str, os.DirEntry[str]]] = []
    visited: set[str] = set()

    def visit(folder: str, rel: str) -> None:
        real = os.path.realpath(folder)
        if real in visited:
            return
        visited.add(real)
        try:
            with os.scandir(folder) as listing:
                entries = sorted(listing, key=lambda entry: entry.name)
        except OSError as exc:
            raise StageError(f"{folder}: cannot list this folder ({exc.strerror or exc})") from None
        for entry in entries:
            path = f"{rel}/{entry.name}" if rel else entry.name
            if entry.is_dir():  # follows symlinks, like os.walk(followlinks=True)
                visit(entry.path, path)
            else:
                found.append((path, entry))

    visit(os.fspath(root), "")
    found.sort(key=lambda pair: pair[0])
    return found


def discover(
    root: Path, *, role: str, class_names: tuple[str, ...]
) -> tuple[list[Candidate], list[Hashed], list[dict[str, str]]]:
    """Candidates (labelled by `class_names`) with their sizes (digest "": pass 1 hashes only files
    whose size another file shares), and ignored files, of one root, in path order."""
    candidates: list[Candidate] = []
    sizes: list[Hashed] = []
    ignored: list[dict[str, str]] = []
    index = {name: i for i, name in enumerate(class_names)}
    for rel, entry in _walk_files(root):
        parts = rel.split("/")
        if any(part.startswith(".") for part in parts):
            reason = "hidden"
        elif len(parts) < 2:
            reason = "outside_class_folder"
        elif not entry.is_file():  # fifos, sockets, broken links: never opened
            reason = "not_a_file"
        elif not is_image_name(rel):
            reason = "not_image_name"
        else:
            candidates.append(Candidate(role, rel, index[parts[0]]))
            sizes.append(_size(entry))
            continue
        ignored.append({"root": role, "path": rel, "reason": reason})
    return candidates, sizes, ignored


def _size(entry: os.DirEntry[str]) -> Hashed:
    """The file's size alone (digest ""): files of different sizes cannot have the same bytes."""
    try:
        return Hashed("", entry.stat().st_size)
    except OSError as exc:
        return Hashed("", -1, f"{type(exc).__name__}: {exc.strerror or exc}")


def worker_init() -> None:
    # preprocess.max_pixels is checked per file from the header; Pillow's own process-wide limit
    # is switched off in the worker processes only, so it never overrides the configured one.
    Image.MAX_IMAGE_PIXELS = None


def _read(roots: tuple[tuple[str, Path], ...], item: Candidate) -> bytes:
    return (dict(roots)[item.root] / item.path).read_bytes()


def hash_file(roots: tuple[tuple[str, Path], ...], item: Candidate) -> Hashed:
    path = os.path.join(dict(roots)[item.root], item.path)
    try:  # streamed: a huge non-image file with an image name costs no memory here
        return Hashed(*sha256_and_size(path))
    except OSError as exc:
        return Hashed("", -1, f"{type(exc).__name__}: {exc.strerror or exc}")


def check_file(config: CheckConfig, item: Candidate) -> Checked:
    """Read, hash and fully decode one file to the model's input; bad data gives a reason code."""
    try:
        data = _read(config.roots, item)
    except OSError as exc:
        return Checked("", None, "unreadable", f"{type(exc).__name__}: {exc.strerror or exc}")
    digest = sha256_bytes(data)
    spec = config.spec
    try:
        img, shape = decode_sized(data, max_pixels=config.max_pixels, min_side=config.min_side,
                                  draft_size=spec.draft_size())  # fmt: skip
    except ImageError as exc:
        return Checked(digest, None, exc.reason, exc.detail, len(data))
    array = to_square(img, spec.image_size, spec.resize, spec.interpolation)
    return Checked(digest, array, size=len(data), shape=shape)


def probe_shape(roots: tuple[tuple[str, Path], ...], item: Candidate) -> tuple[int, int] | None:
    """(width, height) from the file's header alone, EXIF orientation applied; None when it cannot be read.
    What `preprocess.resize: auto` measures before any image is decoded (the decode pass checks each file)."""
    try:
        with Image.open(os.path.join(dict(roots)[item.root], item.path)) as img:
            width, height = img.size
            if img.getexif().get(EXIF_ORIENTATION) in TRANSPOSED:
                width, height = height, width
    except Exception:  # bad bytes are the decode pass's to report, with their reason
        return None
    return (width, height) if width > 0 and height > 0 else None
