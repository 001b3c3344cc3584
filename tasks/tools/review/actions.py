"""The reviewer's decisions on review images -> moves inside the review folder and lines of the decision log.

label: into <review_dir>/<class>/ (the take-in merges class folders); discard: into <review_dir>/.discarded/<class>/
(hidden: no merge takes it, nothing is deleted); undo: the newest decision that stands, moved back, logged as an
undo line (the log is append-only). An image goes under its name, or as `<stem>-<sha256[:12]><ext>` where the
target folder has another image of that name (the log line records the name it had). Each request names where
the page saw each image: moved since, it is a 409. The log is read before anything moves, and a failed log write
puts the images back.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tasks.images.class_names import check_class_name
from tasks.tools.review.decisions import last_batch
from tasks.tools.review.fix import undo_fix
from tasks.tools.review.items import Item, classes, find, list_items, resolve
from tasks.tools.review.moves import Move, move_all, remove_duplicate, restore_duplicate
from tasks.tools.review.refusals import BadInput, Refusal
from tasks.tools.review.state import DISCARDED, Review


def _unique(refs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    if not refs:
        raise BadInput("no image selected: click one first")
    return list(dict.fromkeys(refs))


def _target(review: Review, item: Item, to: str) -> Path:
    """Where `item` goes in folder `to`: its name, or its name and its id's start where another image has it."""
    target = review.review_dir / to / item.name
    if os.path.lexists(target) or os.path.lexists(target.with_suffix(".json")):
        target = target.with_name(f"{target.stem}-{item.id[:12]}{target.suffix}")
    return target


def _apply(review: Review, what: str, moves: list[tuple[Item, str]]) -> list[dict[str, Any]]:
    """Move each (item, to folder), or remove it where its bytes are there already (filed before: the decision
    stands); log one line each; a failed log write puts the moved images back."""
    planned, duplicates, lines = [], [], []
    for item, to in moves:
        image = review.review_dir / item.folder / item.name
        line = {"what": what, "sha256": item.id, "from": item.folder, "to": to, "name": item.name}
        there = find(review, item.id, to) if to != item.folder else None
        if there is not None:  # its sidecar kept in the log, for an undo to put it back
            duplicates.append(image)
            line |= {"duplicate": True, "sidecar": item.sidecar or None}
        else:
            planned.append(Move(image, image if to == item.folder else _target(review, item, to)))
        lines.append(line)
    pending = review.log.plan(lines)
    move_all(planned)
    try:
        written = review.log.write(pending)
    except BaseException:
        move_all([Move(m.target, m.image) for m in reversed(planned)])
        raise
    for image in duplicates:
        remove_duplicate(image)
    return written


def label(review: Review, refs: list[tuple[str, str]], to: str | None = None) -> list[dict[str, Any]]:
    """File each image under class `to`; `to` None: under the model's guess for it (Enter)."""
    with review.lock:
        known = {c["name"] for c in classes(review, list_items(review)) if c["name"]}
        if to is not None:
            check_class_name(to, known)
        items = resolve(review, _unique(refs))
        moves = []
        for item in items:
            target = to if to is not None else item.guess
            if target is None:
                raise BadInput(f"image {item.id[:12]} has no model guess: press a class key")
            moves.append((item, check_class_name(target, known)))
        return _apply(review, "label", moves)


def discard(review: Review, refs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    with review.lock:
        items = resolve(review, _unique(refs))
        return _apply(review, "discard", [(item, f"{DISCARDED}/{item.folder.split('/')[-1]}") for item in items])


def add_class(review: Review, name: str) -> str:
    """A class the dataset does not have yet: checked as a folder name, then offered (with a key) on the page."""
    with review.lock:
        check_class_name(name, {c["name"] for c in classes(review, list_items(review)) if c["name"]})
        if name not in review.new_classes:
            review.new_classes.append(name)
        return name


def undo(review: Review) -> list[dict[str, Any]]:
    """The newest decision that stands, reversed (every image of its batch), and logged as undo lines."""
    with review.lock:
        batch = last_batch(review.log.entries())
        if not batch:
            raise Refusal(f"undo: nothing to undo, no decision in {review.log.path} stands")
        first = batch[0]
        if first["what"] == "take-in":
            raise Refusal(f"undo: the newest decision ({first['who']}'s take-in into {first['to']} at "
                          f"{first['when']}) is undone in git, not here")  # fmt: skip
        if first["what"] == "accept":
            raise Refusal(f"undo: the newest decision ({first['who']}'s accept of the gate at {first['when']}) is "
                          "undone in git, not here")  # fmt: skip
        if first["what"] == "fix-in-place":
            return undo_fix(review, batch)
        items = resolve(review, [(e["sha256"], e["to"]) for e in batch])
        pending = review.log.plan([{"what": "undo", "undoes": e["batch"], "undid": e["what"], "sha256": e["sha256"],
                                    "from": e["to"], "to": e["from"]} for e in batch])  # fmt: skip
        moves, restores = [], []
        for e, item in zip(batch, items, strict=True):
            back = (review.review_dir / e["to"] / item.name, review.review_dir / e["from"] / e.get("name", item.name))
            (restores if e.get("duplicate") else moves).append((*back, e.get("sidecar")))
        planned = [Move(kept, image) for kept, image, _ in moves]
        move_all(planned)
        restored = []
        try:
            for kept, image, sidecar in restores:
                restore_duplicate(kept, image, sidecar)
                restored.append(image)
            return review.log.write(pending)
        except BaseException:
            for image in restored:
                remove_duplicate(image)
            move_all([Move(m.target, m.image) for m in reversed(planned)])
            raise
