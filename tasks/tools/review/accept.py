"""Accepting the gate's decision from the page: `python -m tasks.tools.promote --accept "<reason>"`, then
`python -m dvc repro --single-item check_regression` (what `make promote ACCEPT=...` runs), as subprocesses of
this venv; their output and exit statuses go to the page, and an accept line to the decision log.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from tasks.tools.review.dvc_lock import check_unlocked
from tasks.tools.review.refusals import BadInput
from tasks.tools.review.state import Review

TIMEOUT_S = 3600  # the gate scores both models on the test split


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
    """promote --accept, then the gate again if promote succeeded; every step's command, status and output."""
    reason = reason.strip()
    if not reason:
        raise BadInput("accept: the reason is empty; say why")
    with review.lock:
        check_unlocked(review.root, "accept")
        steps = [_run(review, ["-m", "tasks.tools.promote", "--accept", reason])]
        if steps[0]["status"] == 0:
            steps.append(_run(review, ["-m", "dvc", "repro", "--single-item", "check_regression"]))
        ok = all(step["status"] == 0 for step in steps)
        review.log.append([{"what": "accept", "reason": reason, "ok": ok,
                            "statuses": {s["command"]: s["status"] for s in steps}}])  # fmt: skip
        return {"ok": ok, "steps": steps}
