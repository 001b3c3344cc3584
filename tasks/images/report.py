"""What preprocess tells the user at the end: whether the accepted images can fill every class and both
splits (else one StageError naming the folder), and a summary of what was quarantined or ignored, by
reason, with the first few files named (quarantine.json lists them all)."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

from tasks.core.errors import StageError
from tasks.images.layout import Layout
from tasks.images.shards import QUARANTINE
from tasks.images.splits import Plan
from tasks.images.validation import SOURCE, TEST_SOURCE

log = logging.getLogger(__name__)


def check_usable(
    layout: Layout, files: list[dict[str, Any]], split_counts: dict[str, int], quarantined: list[dict[str, str]]
) -> None:
    """Every class has a usable training image, and both the train and the test split have images."""
    class_names, source, test_source = layout.class_names, layout.folder(SOURCE), layout.folder(TEST_SOURCE)
    empty = sorted(set(class_names) - {class_names[f["label"]] for f in files if f["root"] == SOURCE})
    if empty:
        refused = Counter(q["path"].split("/", 1)[0] for q in quarantined if q["root"] == SOURCE)
        detail = ", ".join(f"{name} ({refused[name]} quarantined)" for name in empty)
        raise StageError(f"data.source {source}: class folders with no usable image: {detail}")
    if not split_counts["train"] or not split_counts["test"]:
        where = f"data.source {source}"
        if test_source is not None and not split_counts["test"]:
            where = f"{'data.test_source' if layout.kind == 'class folders' else 'data.source'} {test_source}"
        raise StageError(f"{where}: too few usable images to fill the train and test splits ({split_counts})")


SHOWN_PER_REASON = 3  # files named per reason in the log; quarantine.json lists them all


def name_files(group: list[dict[str, str]]) -> str:
    """'cat/a.jpg (zero bytes), test_source:dog/b.png, and 4 more': the first few, then a count."""
    names = []
    for entry in group[:SHOWN_PER_REASON]:
        name = entry["path"] if entry.get("root", SOURCE) == SOURCE else f"{entry['root']}:{entry['path']}"
        detail = entry.get("detail", "")
        names.append(f"{name} ({detail})" if detail and len(detail) <= 80 else name)
    more = len(group) - SHOWN_PER_REASON
    return ", ".join(names) + (f", and {more} more" if more > 0 else "")


def log_summary(
    quarantined: list[dict[str, str]],
    ignored: list[dict[str, str]],
    todo: Plan,
    counts: dict[str, int],
    split_counts: dict[str, int],
    class_names: tuple[str, ...],
    out_dir: Path,
) -> None:
    """What was refused or ignored, by reason with the first files named, and what was written."""
    report = out_dir / QUARANTINE
    for what, entries in (("quarantined", quarantined), ("ignored", ignored)):
        by_reason: dict[str, list[dict[str, str]]] = {}
        for entry in entries:
            by_reason.setdefault(entry["reason"], []).append(entry)
        for reason, group in sorted(by_reason.items()):
            log.info("%s %d file(s): %s: %s", what, len(group), reason, name_files(group))
    if quarantined or ignored:
        log.info("every quarantined and ignored file, with its reason: %s", report)
    if todo.duplicates:
        log.info("%d group(s) of files with identical bytes (listed in %s)", len(todo.duplicates), QUARANTINE)
    log.info("%s; splits %s; %d classes -> %s", counts, split_counts, len(class_names), out_dir)
