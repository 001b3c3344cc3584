"""Each finished epoch as one JSON line in train's output: what a watcher of the run (a sweep's pruner,
flows/sweep/trial.py) reads while the stage runs, instead of parsing the human line beside it.

The line is `epoch-record {"epoch": 1, "val_accuracy": ..., ...}`, the history row of that epoch (the same
keys as reports/train_history.json). Writer and reader are both here, so a change to one is a change to both.
"""

from __future__ import annotations

import json
from typing import Any

MARKER = "epoch-record "


def epoch_line(row: dict[str, Any]) -> str:
    """The record of one epoch's history row, as train logs it."""
    return MARKER + json.dumps(row, sort_keys=True)


def read_epoch_line(line: str) -> dict[str, Any] | None:
    """The history row a line of train's output carries (a log prefix or a progress bar's redraw before it is
    skipped), or None for any other line."""
    start = line.find(MARKER)
    if start < 0:
        return None
    try:
        row, _ = json.JSONDecoder().raw_decode(line, start + len(MARKER))
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) and "epoch" in row else None
