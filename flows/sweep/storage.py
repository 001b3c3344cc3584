"""Where the sweep's study lives: Optuna's journal under runs/sweep/ (the default, one machine), or, with
`sweep.storage` a database URL, Optuna's RDBStorage (PostgreSQL through SQLAlchemy), which the trials of several
machines share.

In a database, a running trial beats: its runner records a heartbeat every `sweep.heartbeat_s` (`beating`).
A trial silent for GRACE_BEATS heartbeats (its machine died, or its worker) is failed by the study's side
(`fail_stale`, Optuna's fail_stale_trials) and Optuna's RetryHeartbeatStaleTrialCallback queues its values again,
so the sweep retries it. An unreachable database is one line naming the URL, its password masked (`open_storage`).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import optuna
from optuna.storages import BaseStorage, JournalStorage, RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.storages.journal import JournalFileBackend

GRACE_BEATS = 3  # heartbeats a running trial may miss before it is failed and retried
RETRIES = 2  # a trial whose machine died is retried at most this many times
CONNECT_TIMEOUT_S = 10


class StorageUnreachable(RuntimeError):
    """sweep.storage does not answer: one line naming the URL (password masked)."""


def masked(url: str) -> str:
    """The URL with its password as ***, for messages and logs."""
    import sqlalchemy

    try:
        return sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - a URL SQLAlchemy cannot parse: at least no password after a colon
        head, at, tail = url.rpartition("@")
        return f"{head.split(':', 2)[0]}:{head.split(':', 2)[1]}:***@{tail}" if at and head.count(":") >= 2 else url


def open_storage(url: str, journal: Path, heartbeat_s: int) -> BaseStorage:
    """The study's storage: the journal file when `url` is empty, else the database at `url` with heartbeats."""
    if not url:
        journal.parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(str(journal)))
    connect = {"connect_timeout": CONNECT_TIMEOUT_S} if url.startswith("postgresql") else {}
    # Heartbeats are marked experimental, and said to be meant for study.optimize: this sweep beats itself (below)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
    try:
        return RDBStorage(
            url,
            engine_kwargs={"pool_pre_ping": True, "connect_args": connect},
            heartbeat_interval=heartbeat_s,
            grace_period=GRACE_BEATS * heartbeat_s,
            heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=RETRIES),
        )
    except Exception as exc:  # noqa: BLE001 - SQLAlchemy's OperationalError, a missing driver, a refused login
        said = (str(getattr(exc, "orig", None) or exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise StorageUnreachable(f"sweep.storage {masked(url)} cannot be reached: {said}") from None


def fail_stale(study: optuna.Study) -> list[int]:
    """Running trials whose heartbeat stopped: failed, their values queued again (the retry callback). Returns
    their numbers; nothing for the journal, which has no heartbeats."""
    before = {t.number for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))}
    if not before:
        return []
    optuna.storages.fail_stale_trials(study)
    now = {t.number: t.state for t in study.get_trials(deepcopy=False) if t.number in before}
    return sorted(n for n, state in now.items() if state == optuna.trial.TrialState.FAIL)


def retry_of(study: optuna.Study, number: int) -> int | None:
    """The number of the trial whose machine died, when trial `number` is its retry (the callback's copy)."""
    frozen = next(t for t in study.get_trials(deepcopy=False) if t.number == number)
    return RetryHeartbeatStaleTrialCallback.retried_trial_number(frozen)


@contextmanager
def beating(storage: BaseStorage, trial_id: int) -> Iterator[None]:
    """Record the trial's heartbeat every heartbeat interval while the block runs (nothing for the journal)."""
    # RDBStorage, or the cache Optuna wraps it in (a study's own storage): both beat; the journal does not
    interval = storage.get_heartbeat_interval() if isinstance(storage, BaseHeartbeat) else None
    if interval is None:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while True:
            with contextlib.suppress(Exception):  # a missed beat; the next one tries again
                storage.record_heartbeat(trial_id)
            if stop.wait(interval):
                return

    thread = threading.Thread(target=beat, name=f"heartbeat-{trial_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)
