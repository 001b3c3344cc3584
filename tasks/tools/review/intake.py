"""The take-in: the review folder's decided images -> the DVC-tracked dataset, by the merge of
`make add-data SRC=<review_dir> INTO=<name>` (tasks/tools/data_merge.py), with the decision log's length and
sha256 recorded in the dataset's .dvc meta (meta.merges) and a take-in line in the log.

The images labelled by a decision that stands are taken; the others wait in the review folder and the summary
says how many: those with no decision yet (a live server keeps adding some), and label-error candidates filed
under another class than the dataset gives them (the merge would refuse them: fix them in place, or discard them).
Refused in one line, before anything moves, while DVC is at work or when no image is ready. The images taken are
moved into a hidden staging folder (<review_dir>/.take-in-<pid>/<class>/) and merged from there, so an upload the
server saves meanwhile stays for review; whatever the merge did not take (all of it when it fails) goes back.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from tasks.images.imaging import is_image_name
from tasks.images.review_folder import image_id
from tasks.tools.data_merge import merge
from tasks.tools.review.decisions import standing_by_image
from tasks.tools.review.dvc_lock import check_unlocked
from tasks.tools.review.fix import keep_command
from tasks.tools.review.items import Item, list_items
from tasks.tools.review.moves import Move, is_duplicate, move_one, remove_duplicate
from tasks.tools.review.refusals import Refusal
from tasks.tools.review.state import Review

STAGING = ".take-in-"  # + the pid of the page that merges from it; hidden: the page and the server skip it
log = logging.getLogger(__name__)


@contextmanager
def _said(logger: str) -> Iterator[list[str]]:
    """The lines `logger` logs meanwhile (the merge's own summary), for the page."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger(logger)
    log.addHandler(handler)
    old = log.level
    log.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        log.removeHandler(handler)
        log.setLevel(old)


def _check_ready(review: Review) -> tuple[list[Item], dict[str, int]]:
    """The review folder's images labelled by a decision that stands, and how many of the others wait (no
    decision yet; relabelled label-error candidates); one refusal when none is ready."""
    items = list_items(review)
    if not items:
        raise Refusal(f"take-in: {review.review_dir} has no images to take in")
    standing = standing_by_image(review.log.entries())
    decided = [i for i in items if standing.get(i.id, {}).get("what") == "label" and standing[i.id]["to"] == i.folder]
    crossed = [i for i in decided if i.candidate and i.sidecar.get("given") not in (None, i.folder)]
    ready = [i for i in decided if i not in crossed]
    if not ready and crossed:
        first = crossed[0]
        raise Refusal(f"take-in: {len(crossed)} label-error candidate(s) relabelled (first: "
                      f"{first.sidecar.get('file')}, {first.sidecar.get('given')} -> {first.folder}); fix in place (f) "
                      "or discard (x) them first")  # fmt: skip
    if not ready:
        first = items[0]
        raise Refusal(f"take-in: none of the {len(items)} image(s) has a decision yet (first: {first.folder}/"
                      f"{first.name}); label or discard (x) them first")  # fmt: skip
    return ready, {"undecided": len(items) - len(decided), "relabelled_candidates": len(crossed)}


def _put_back(review: Review, staging: Path) -> list[str]:
    """Every image left in `staging` (with its sidecar) back in its class folder, where the same bytes saved there
    meanwhile make it a duplicate, removed; the emptied staging folder goes. Returns the ids put back; what cannot
    go back stays in `staging` (the next take-in tries again) and is named in one refusal."""
    back, stuck = [], []
    for image in sorted(p for p in staging.rglob("*") if p.is_file() and is_image_name(p.name)):
        move = Move(image, review.review_dir / image.relative_to(staging))
        try:
            sha = image_id(image)
            if is_duplicate(move):
                remove_duplicate(image)
            else:
                move_one(move)
            back.append(sha)
        except (OSError, Refusal) as exc:
            stuck.append(f"{image}: {exc}")
    for folder in sorted((p for p in staging.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(folder.iterdir()):
            folder.rmdir()
    if staging.is_dir() and not any(staging.iterdir()):
        staging.rmdir()
    if stuck:
        raise Refusal(f"take-in: {len(stuck)} image(s) could not go back from {staging} (first: {stuck[0]}); move "
                      f"them into {review.review_dir}/<class>/ by hand")  # fmt: skip
    return back


def restore_stale(review: Review) -> list[str]:
    """What a take-in that did not finish (its page killed mid-merge) left staged, back for review: the ids."""
    if not review.review_dir.is_dir():
        return []
    restored = []
    for staging in sorted(review.review_dir.glob(f"{STAGING}*")):
        pid = staging.name.removeprefix(STAGING)
        if staging.is_dir() and pid.isdigit() and (int(pid) == os.getpid() or not psutil.pid_exists(int(pid))):
            restored += _put_back(review, staging)
    if restored:
        log.warning("%d image(s) of an unfinished take-in back in %s for review", len(restored), review.review_dir)
    return restored


def take_in(review: Review) -> dict[str, Any]:
    """Merge the decided images into the dataset; returns the merge's summary, what it said and the git command."""
    with review.lock:
        dataset = review.need_dataset("take-in")
        check_unlocked(review.root, "take-in")
        restore_stale(review)
        items, waiting = _check_ready(review)
        snapshot = review.log.snapshot()
        staging = review.review_dir / f"{STAGING}{os.getpid()}"
        staged = [Move(review.review_dir / i.folder / i.name, staging / i.folder / i.name) for i in items]
        try:
            for move in staged:  # within the review folder: os.replace, each image with its sidecar
                move_one(move)
            with _said("tasks.tools.data_merge") as said:
                plan = merge(staging, dataset.name, dataset.dest, params=review.params, decisions=snapshot,
                             from_review=True)  # fmt: skip
        finally:  # what the merge did not take (everything, when it failed) goes back
            left = set(_put_back(review, staging))
        summary = {"added": len(plan.add), "skipped": len(plan.skipped), "ignored": plan.ignored,
                   "splits": plan.split_counts() if plan.add else {}, "classes": plan.per_class(),
                   "classes_new": list(plan.classes_new), "waiting": waiting}  # fmt: skip
        line = {"what": "take-in", "from": review.review_dir.as_posix(), "to": dataset.dest.as_posix(),
                "taken": sorted({i.id for i in items} - left), "decisions": snapshot, **summary}  # fmt: skip
        review.log.append([line])
        if plan.add:
            keep = keep_command(review, dataset, f"+{len(plan.add)} reviewed images")
        else:  # the dataset is unchanged; the log has a new line
            keep = f"git add {review.log.path} && git commit -m 'data: {dataset.name}: review decisions'"
        # `keep` adds the log to the merge's own "to keep it"; the staging folder is named as the review folder
        said = [line.replace(str(staging), str(review.review_dir)) for line in said
                if not line.startswith("to keep it:")]  # fmt: skip
        if any(waiting.values()):
            said.append(f"{waiting['undecided']} image(s) with no decision yet and {waiting['relabelled_candidates']} "
                        "relabelled label-error candidate(s) wait in the review folder")  # fmt: skip
        return {**summary, "dataset": str(dataset.dest), "said": said, "keep": keep}
