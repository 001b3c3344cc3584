"""The review page's decision log: one JSON line per image and decision, append-only (an undo is a new line).

Each line: id, batch (the id of the first line of the decision it belongs to: a range assignment is one batch),
what (label / discard / undo / fix-in-place / take-in / accept), sha256, from, to, when (UTC), who; some add
more (undoes, reason, sidecar, ...). The take-in records the log's length and sha256 in the dataset's .dvc meta.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.tools.decision import utc_now
from tasks.tools.review.refusals import Refusal

UNDOABLE = ("label", "discard", "fix-in-place")


@dataclass
class DecisionLog:
    path: Path
    who: str

    def entries(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        found = []
        for number, line in enumerate(self.path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                raise Refusal(f"decision log {self.path} line {number} is not JSON; restore it from git") from None
        return found

    def plan(self, lines: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """`lines` as the next batch (ids, batch, when and who added), not written yet: the log is read (and a
        corrupt one refused) before a decision moves anything."""
        lines = list(lines)
        if not lines:
            return []
        first = max((e["id"] for e in self.entries()), default=0) + 1
        when = utc_now()
        return [{"id": first + i, "batch": first, "what": line["what"], "sha256": line.get("sha256"),
                 "from": line.get("from"), "to": line.get("to"), "when": when, "who": self.who,
                 **{k: v for k, v in line.items() if k not in ("what", "sha256", "from", "to")}}
                for i, line in enumerate(lines)]  # fmt: skip

    def append(self, lines: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """Write `lines` as one batch in a single append; returns them as written."""
        return self.write(self.plan(lines))

    def write(self, planned: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Append a planned batch (DecisionLog.plan) in one write; returns it as written. Its ids are given under
        an exclusive lock on the log file, after the last line written by anyone (another page on this log, a
        decision made while this one moved files), so no two lines share an id."""
        if not planned:
            return []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            first = max((e["id"] for e in self.entries()), default=0) + 1
            written = [{**e, "id": first + i, "batch": first} for i, e in enumerate(planned)]
            data = "".join(json.dumps(e, sort_keys=False) + "\n" for e in written).encode()
            os.write(fd, data)  # one write of whole lines: a reader never sees half a decision
            os.fsync(fd)
        finally:
            os.close(fd)  # and the lock with it
        return written

    def snapshot(self) -> dict[str, Any]:
        """What a take-in records: how many entries the log holds now and the sha256 of its bytes (a later
        reader checks it against the first `entries` lines: the log only grows)."""
        data = self.path.read_bytes() if self.path.is_file() else b""
        entries = sum(1 for line in data.splitlines() if line.strip())
        return {"entries": entries, "sha256": hashlib.sha256(data).hexdigest()}


def effective(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The decisions that stand: no undo line, and none of a batch an undo took back."""
    undone = {e["undoes"] for e in entries if e["what"] == "undo"}
    return [e for e in entries if e["what"] != "undo" and e["batch"] not in undone]


def last_batch(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The newest decision that stands (all lines of its batch), or [] when none is left; a refused accept
    changed nothing and is passed over."""
    standing = [e for e in effective(entries) if not (e["what"] == "accept" and not e.get("ok"))]
    if not standing:
        return []
    batch = standing[-1]["batch"]
    return [e for e in standing if e["batch"] == batch]


def standing_by_image(entries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{sha256: the newest decision that stands about it} (a take-in counts for every image it took)."""
    found: dict[str, dict[str, Any]] = {}
    for entry in effective(entries):
        if entry.get("sha256"):
            found[entry["sha256"]] = entry
        for sha in entry.get("taken", []):
            found[sha] = entry
    return found


def last_touch(entries: list[dict[str, Any]], sha256: str) -> dict[str, Any] | None:
    """The newest line of any kind about `sha256` (an undo too): who moved it last, and where."""
    for entry in reversed(entries):
        if entry.get("sha256") == sha256 or sha256 in entry.get("taken", []):
            return entry
    return None
