"""Test hooks: the IMAGEPIPE_FAULT environment variable -> faults planted at marked places in training.

Only tests set it. Grammar: comma-separated `kind@point:N[:arg]`, each firing once:
    nan@step:N                 the loss of optimizer step N (1-based) becomes NaN
    nan-grad@step:N:PARAM      the gradient of parameter PARAM becomes NaN at step N
    inf-grad@step:N:PARAM      ... becomes +Inf (with fp16 this is an overflow the GradScaler skips)
    oom@step:N                 the first forward of step N raises torch.OutOfMemoryError
    kill@step:N                SIGKILL just before step N runs (mid-epoch when N is not an epoch end)
    kill@after-ckpt:K          SIGKILL right after the K-th checkpoint of this process is on disk
    kill@ckpt-write:K          SIGKILL half-way through writing the K-th checkpoint
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

ENV = "IMAGEPIPE_FAULT"
KINDS = {"nan", "nan-grad", "inf-grad", "oom", "kill"}
POINTS = {"step", "after-ckpt", "ckpt-write"}


class FaultSpecError(ValueError):
    pass


@dataclass
class Faults:
    pending: dict[tuple[str, str, int], str] = field(default_factory=dict)  # (kind, point, n) -> arg

    @classmethod
    def parse(cls, text: str) -> Faults:
        pending = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            try:
                kind, rest = item.split("@", 1)
                point, number, *arg = rest.split(":", 2)
                n = int(number)
            except ValueError:
                raise FaultSpecError(f"{ENV}: cannot parse {item!r} (expected kind@point:N[:arg])") from None
            if kind not in KINDS or point not in POINTS:
                raise FaultSpecError(f"{ENV}: unknown fault {item!r}; kinds {sorted(KINDS)}, points {sorted(POINTS)}")
            if kind.endswith("-grad") and not arg:
                raise FaultSpecError(f"{ENV}: {item!r} needs a parameter name ({kind}@step:N:PARAM)")
            pending[(kind, point, n)] = arg[0] if arg else ""
        return cls(pending)

    @classmethod
    def from_env(cls) -> Faults:
        return cls.parse(os.environ.get(ENV, ""))

    def take(self, kind: str, point: str, n: int) -> str | None:
        """The fault's argument ('' when it has none) if it is due now; it fires only once."""
        return self.pending.pop((kind, point, n), None)

    def kill_if_due(self, point: str, n: int) -> None:
        if self.take("kill", point, n) is not None:
            self.kill_now()

    @staticmethod
    def kill_now() -> None:
        os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer or `kill -9` does: no cleanup at all
