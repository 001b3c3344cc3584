"""Accepting the gate's decision from the page: `python -m tasks.tools.promote --accept "<reason>"` (what
`make promote ACCEPT=...` runs; promote runs the gate against the new baseline itself), as a subprocess of this
venv; its output and exit status go to the page, and an accept line to the decision log. It runs beside the
page's decisions (promote changes baseline/, not the review folder): labelling goes on while the gate scores, and
a second accept while one runs is refused.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from tasks.tools.review.dvc_lock import check_unlocked
from tasks.tools.review.refusals import BadInput, Refusal
from tasks.tools.review.state import Review

TIMEOUT_S = 3600  # promote's gate scores both models on the test split


def _run(review: Review, args: list[str]) -> dict[str, Any]:
    shown = " ".join(["python", *args])
    try:
        proc = subprocess.run([sys.executable, *args], cwd=review.root, capture_output=True, text=True,
                              timeout=TIMEOUT_S)  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return {"command": shown, "status": None, "output": f"{out}\n(stopped after {TIMEOUT_S} s)"}
    return {"command": shown, "status": proc.returncode, "output": proc.stdout + proc.stderr}


def accept(review: Review, reason: str) -> dict[str, Any]:
    """promote --accept (one step: its command, status and output)."""
    reason = reason.strip()
    if not reason:
        raise BadInput("accept: the reason is empty; say why")
    if not review.accepting.acquire(blocking=False):
        raise Refusal("accept: another accept is running on this page; wait for its result")
    try:
        with review.lock:
            check_unlocked(review.root, "accept")
            review.log.entries()  # a log that cannot be read is refused before promote changes baseline/
        steps = [_run(review, ["-m", "tasks.tools.promote", "--accept", reason])]
        ok = all(step["status"] == 0 for step in steps)
        with review.lock:
            review.log.append([{"what": "accept", "reason": reason, "ok": ok,
                                "statuses": {s["command"]: s["status"] for s in steps}}])  # fmt: skip
        return {"ok": ok, "steps": steps}
    finally:
        review.accepting.release()
