"""The take-in: the review folder's labelled images -> the DVC-tracked dataset, by the merge of
`make add-data SRC=<review_dir> INTO=<name>` (tasks/tools/data_merge.py), with the decision log's length and
sha256 recorded in the dataset's .dvc meta (meta.merges) and a take-in line in the log.

Refused in one line, before anything moves: while DVC's lock is held, while an image has no decision yet (the
merge takes every image of the class folders), and while a label-error candidate is filed under another class
than the dataset gives it (the merge would refuse the whole merge: fix it in place, or discard it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tasks.tools.data_merge import merge
from tasks.tools.review.decisions import standing_by_image
from tasks.tools.review.dvc_lock import check_unlocked
from tasks.tools.review.fix import keep_command
from tasks.tools.review.items import list_items
from tasks.tools.review.refusals import Refusal
from tasks.tools.review.state import Review


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


def _check_ready(review: Review) -> None:
    items = list_items(review)
    if not items:
        raise Refusal(f"take-in: {review.review_dir} has no images to take in")
    standing = standing_by_image(review.log.entries())
    undecided = [i for i in items if not (standing.get(i.id, {}).get("what") == "label"
                                          and standing[i.id]["to"] == i.folder)]  # fmt: skip
    if undecided:
        raise Refusal(f"take-in: {len(undecided)} of {len(items)} image(s) have no decision yet (first: "
                      f"{undecided[0].folder}/{undecided[0].name}); label or discard (x) them first")  # fmt: skip
    crossed = [i for i in items if i.candidate and i.sidecar.get("given") not in (None, i.folder)]
    if crossed:
        first = crossed[0]
        raise Refusal(f"take-in: {len(crossed)} label-error candidate(s) relabelled (first: "
                      f"{first.sidecar.get('file')}, {first.sidecar.get('given')} -> {first.folder}); fix in place (f) "
                      "or discard (x) them first")  # fmt: skip


def take_in(review: Review) -> dict[str, Any]:
    """Merge the review folder into the dataset; returns the merge's summary, what it said and the git command."""
    with review.lock:
        dataset = review.need_dataset("take-in")
        check_unlocked(review.root, "take-in")
        _check_ready(review)
        taken = {i.id for i in list_items(review)}
        snapshot = review.log.snapshot()
        with _said("tasks.tools.data_merge") as said:
            plan = merge(review.review_dir, dataset.name, dataset.dest, params=review.params, decisions=snapshot)
        left = {i.id for i in list_items(review)}
        summary = {"added": len(plan.add), "skipped": len(plan.skipped), "ignored": plan.ignored,
                   "splits": plan.split_counts() if plan.add else {}, "classes": plan.per_class(),
                   "classes_new": list(plan.classes_new)}  # fmt: skip
        line = {"what": "take-in", "from": review.review_dir.as_posix(), "to": dataset.dest.as_posix(),
                "taken": sorted(taken - left), "decisions": snapshot, **summary}  # fmt: skip
        review.log.append([line])
        if plan.add:
            keep = keep_command(review, dataset, f"+{len(plan.add)} reviewed images")
        else:  # the dataset is unchanged; the log has a new line
            keep = f"git add {review.log.path} && git commit -m 'data: {dataset.name}: review decisions'"
        said = [line for line in said if not line.startswith("to keep it:")]  # `keep` adds the log to it
        return {**summary, "dataset": str(dataset.dest), "said": said, "keep": keep}
