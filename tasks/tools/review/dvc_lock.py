"""Is DVC at work in the project (`make run`'s `dvc repro`, a `dvc add`)? Asked through tasks.core.private_api
`dvc_busy`, which reads DVC's repository lock and, for a stage whose command is running, its rwlock file.

A take-in, a fix-in-place or an accept refuses in one line while DVC is at work, before anything moves: their
`dvc status` / `dvc add` would wait on it or fail half-way through, or change data a running stage reads.
"""

from __future__ import annotations

from pathlib import Path

from tasks.core.private_api import dvc_busy
from tasks.tools.review.refusals import Refusal


def check_unlocked(root: Path, action: str) -> None:
    """Refusal naming the DVC process at work (`pid N (its command)`); returns when none is."""
    busy = dvc_busy(root)
    if busy is not None:
        raise Refusal(f"{action}: DVC is at work ({busy}): `make run` or another DVC command; try again when it is "
                      "done, nothing was moved")  # fmt: skip
