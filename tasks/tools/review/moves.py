"""Moving review images between folders of the review folder: image and sidecar together, atomically
(os.replace within one filesystem), so that an image is never without its sidecar and a batch is all or nothing.

The sidecar goes first (linked into the new folder, as the server writes it before the image), then the image
(os.replace), then the old sidecar name is removed; a `<stem>.json` that is another image's (tasks/images/
review_folder.py) stays. A failure part-way puts every moved file back. The same
bytes already at the target (an image uploaded again after its decision) are a duplicate: removed, not moved.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.core.io import sha256_file
from tasks.images.review_folder import image_id, owns_sidecar
from tasks.tools.review.refusals import Gone, Refusal


@dataclass(frozen=True)
class Move:
    image: Path  # where it is
    target: Path  # where it goes (another folder; its own name, or that name and its id's start)

    @property
    def sidecars(self) -> tuple[Path, Path]:
        return self.image.with_suffix(".json"), self.target.with_suffix(".json")


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a filesystem without hard links: a copy, renamed in
        tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
        shutil.copy2(src, tmp)
        os.replace(tmp, dst)


def move_one(move: Move) -> None:
    old_sidecar, new_sidecar = move.sidecars
    if move.target.exists() or new_sidecar.exists():
        raise Refusal(f"{move.target}: already there (the same image, filed twice?); nothing was moved")
    move.target.parent.mkdir(parents=True, exist_ok=True)
    try:
        has_sidecar = old_sidecar.is_file() and owns_sidecar(move.image, image_id(move.image))
    except FileNotFoundError:
        raise Gone(f"{move.image}: gone while being moved; reload the page") from None
    if has_sidecar:
        _link(old_sidecar, new_sidecar)
    try:
        os.replace(move.image, move.target)
    except FileNotFoundError:
        if has_sidecar:
            new_sidecar.unlink(missing_ok=True)
        raise Gone(f"{move.image}: gone while being moved; reload the page") from None
    except BaseException:
        if has_sidecar:
            new_sidecar.unlink(missing_ok=True)
        raise
    if has_sidecar:
        old_sidecar.unlink(missing_ok=True)


def move_all(moves: list[Move]) -> None:
    """Every move, or none: a failure puts back the ones done (in reverse) and raises the first error."""
    done: list[Move] = []
    try:
        for move in moves:
            if move.image != move.target:
                move_one(move)
                done.append(move)
    except BaseException:
        for move in reversed(done):
            move_one(Move(move.target, move.image))
        raise


def is_duplicate(move: Move) -> bool:
    """The image's bytes are at the target already: the decision was made before (its name is its sha256)."""
    return move.image != move.target and move.target.is_file() and move.image.is_file() and \
        sha256_file(move.image) == sha256_file(move.target)  # fmt: skip


def remove_duplicate(image: Path) -> None:
    """The image, then its sidecar: an image never lacks its sidecar."""
    image.unlink(missing_ok=True)
    image.with_suffix(".json").unlink(missing_ok=True)


def restore_duplicate(kept: Path, image: Path, sidecar: dict[str, Any] | None) -> None:
    """A removed duplicate back at `image`: its sidecar as logged, then a copy of the bytes kept at `kept`."""
    if os.path.lexists(image) or os.path.lexists(image.with_suffix(".json")):
        raise Refusal(f"undo: {image} exists again; nothing was moved")
    image.parent.mkdir(parents=True, exist_ok=True)
    if sidecar is not None:
        image.with_suffix(".json").write_text(json.dumps(sidecar, indent=2))
    tmp = image.with_name(f".{image.name}.tmp-{os.getpid()}")
    try:  # a copy renamed in: a reader never sees half an image
        shutil.copy2(kept, tmp)
        os.replace(tmp, image)
    except BaseException:
        tmp.unlink(missing_ok=True)
        image.with_suffix(".json").unlink(missing_ok=True)
        raise
