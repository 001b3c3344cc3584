"""One sweep trial: a DVC experiment (`dvc exp run -n <name> -S key=value ...`) in its own temporary copy.

The copy is a `git clone --shared` of this repository at its HEAD commit under runs/sweep/<study>/, sharing
this workspace's DVC cache (hard links where the file system allows): the committed run's outputs come from
the cache, so only train and what follows it run, and what the trial makes lands in the same cache. Trials
never share a workspace, a dvc.lock or DVC's experiment refs (DVC's own queue with -j > 1 does, and has lost
experiments). A finished trial's experiment ref is fetched into this repository, so `dvc exp show` lists it
and `dvc exp apply <name>` applies it (its outputs are in the shared cache).

While it runs, each epoch's validation accuracy (the train stage's `epoch N: ... val loss L acc A` line) is
handed to `report`; when that says prune, the trial's process group is stopped and the copy removed: a
pruned trial leaves no model.pt, no lock entry, no verdict and no experiment. A trial whose process dies
(kill -9 included) is a failed trial; the copy goes all the same, and the workspace is never touched.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flows.sweep.space import set_args
from tasks.core.io import read_json

EPOCH_LINE = re.compile(r"\[train\] epoch (\d+): .*\| val loss \S+ acc ([0-9.]+)")
PROGRESS = re.compile(r"\d+%\|")  # a tqdm redraw
_FETCH = threading.Lock()  # one `git fetch` into this repository at a time
_LIVE: set[subprocess.Popen[str]] = set()  # the trials running now (stop_all stops them)
_LIVE_LOCK = threading.Lock()


@dataclass
class TrialResult:
    number: int
    name: str
    values: dict[str, Any]
    seed: int | None
    state: str = "failed"  # complete | pruned | failed
    epochs: list[float] = field(default_factory=list)  # validation accuracy after each epoch, as reported
    val_accuracy: float | None = None  # the objective: the kept model's validation accuracy
    test_accuracy: float | None = None
    verdict: str | None = None
    restored: bool = False  # DVC restored train from its run cache: no epoch ran here
    message: str = ""
    seconds: float = 0.0


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True)


def _dvc(*args: str) -> list[str]:
    return [sys.executable, "-m", "dvc", *args]


def cache_dir(repo: Path) -> Path:
    proc = _run(_dvc("cache", "dir"), repo)
    return Path(proc.stdout.strip()) if proc.returncode == 0 and proc.stdout.strip() else repo / ".dvc" / "cache"


def prepare_copy(repo: Path, copy: Path, commit: str, cache: Path) -> None:
    """A clone of `commit` in `copy` that shares this repository's objects and DVC cache, its outputs checked out."""
    steps = [
        (["git", "clone", "--quiet", "--shared", "--no-checkout", str(repo), str(copy)], repo),
        (["git", "checkout", "--quiet", "--detach", commit], copy),
    ]
    for args, cwd in steps:
        proc = _run(args, cwd)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args[:2])} failed: {proc.stderr.strip()[-300:]}")
    local = repo / ".dvc" / "config.local"
    if local.is_file():
        shutil.copy2(local, copy / ".dvc" / "config.local")
    for args in (
        ("cache", "dir", "--local", str(cache)),
        ("config", "--local", "cache.type", "hardlink,symlink,copy"),
        ("config", "--local", "core.analytics", "false"),
    ):
        proc = _run(_dvc(*args), copy)
        if proc.returncode != 0:
            raise RuntimeError(f"dvc {' '.join(args[:2])} failed in the trial's copy: {proc.stderr.strip()[-300:]}")
    # The committed run's outputs (and .dvc-tracked inputs) from the shared cache; what is missing, DVC reruns.
    _run(_dvc("checkout", "--quiet"), copy)


def fetch_experiment(repo: Path, copy: Path, name: str) -> str | None:
    """The trial's experiment ref, fetched from its copy into this repository. Returns the ref."""
    refs = _run(["git", "for-each-ref", "--format=%(refname)", "refs/exps"], copy).stdout.split()
    found = [r for r in refs if r.endswith(f"/{name}") and "/exec/" not in r]
    if not found:
        return None
    with _FETCH:
        proc = _run(["git", "fetch", "--quiet", str(copy), f"+{found[0]}:{found[0]}"], repo)
    if proc.returncode != 0:
        raise RuntimeError(f"git fetch of experiment {name} failed: {proc.stderr.strip()[-300:]}")
    return found[0]


def clear_leftovers(workdir: Path) -> list[Path]:
    """A killed sweep's trial copies: any process still working in one is killed, then the copy removed. Called
    under the study's lock, so no live sweep owns them. Returns the copies removed."""
    if not workdir.is_dir():
        return []
    copies = [p for p in workdir.iterdir() if p.is_dir()]
    for proc_dir in Path("/proc").glob("[0-9]*"):
        try:
            cwd = (proc_dir / "cwd").resolve(strict=True)
        except OSError:
            continue
        if any(cwd == c.resolve() or c.resolve() in cwd.parents for c in copies):
            with contextlib.suppress(OSError):
                os.kill(int(proc_dir.name), signal.SIGKILL)
    for copy in copies:
        shutil.rmtree(copy, ignore_errors=True)
    return copies


def _stop(proc: subprocess.Popen[str], grace_s: float = 20.0) -> None:
    """The trial's whole process group (dvc, the stage, its threads): SIGTERM, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def core_slots(parallel: int) -> list[list[int]] | None:
    """The CPUs of `parallel` trials sharing this machine: disjoint sets, as even as the cores allow (one core
    each, shared round-robin, when there are fewer cores than trials). None where no CPU affinity can be set."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    return [cores[i::parallel] or [cores[i % len(cores)]] for i in range(parallel)]


def stop_all() -> int:
    """Stop every trial running now (a sweep interrupted with Ctrl-C): their process groups get SIGTERM, then
    SIGKILL. Each trial's thread then sees it failed and removes its copy. Returns how many were stopped."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for proc in live:
        _stop(proc, grace_s=5.0)
    return len(live)


def run_trial(
    repo: Path,
    workdir: Path,
    result: TrialResult,
    *,
    commit: str,
    env: dict[str, str],
    report: Callable[[int, float], bool] | None,
    log: Callable[[str], None],
    extra_sets: list[str] | None = None,
    cores: list[int] | None = None,
) -> TrialResult:
    """Run the trial to its end, its pruning or its failure; fill in `result` and return it. `cores`: the CPUs
    its processes may use (trials that share a machine get disjoint ones; train.threads 0 then counts them)."""
    started = time.monotonic()
    workdir.mkdir(parents=True, exist_ok=True)
    copy = Path(tempfile.mkdtemp(prefix=f"{result.name}-", dir=workdir))
    try:
        prepare_copy(repo, copy, commit, cache_dir(repo))
        seed = ["-S", f"seed={result.seed}"] if result.seed is not None else []
        command = _dvc("exp", "run", "-n", result.name, *set_args(result.values), *seed, *(extra_sets or []))
        log(f"trial {result.name}: {' '.join(command[2:])}  (in {copy})")
        tail: list[str] = []
        pruned = False
        with subprocess.Popen(
            command,
            cwd=copy,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        ) as proc:
            assert proc.stdout is not None
            with _LIVE_LOCK:
                _LIVE.add(proc)
            if cores:  # before dvc starts a thread or a stage: all of them inherit it
                os.sched_setaffinity(proc.pid, cores)
            for raw in proc.stdout:
                line = raw.rstrip().rsplit("\r", 1)[-1]
                if not line:
                    continue
                tail = [*tail[-29:], line]
                if not PROGRESS.search(line) or "100%|" in line:  # a progress bar: its last redraw only
                    log(f"[{result.name}] {line}")
                match = EPOCH_LINE.search(line)
                if match:
                    accuracy = float(match.group(2))
                    result.epochs.append(accuracy)
                    if report is not None and report(int(match.group(1)), accuracy):
                        pruned = True
                        _stop(proc)
                        break
            proc.wait()
            with _LIVE_LOCK:
                _LIVE.discard(proc)
        if pruned:
            result.state = "pruned"
            result.message = f"pruned after epoch {len(result.epochs)} (validation accuracy {result.epochs[-1]:.4f})"
        elif proc.returncode != 0:
            result.state = "failed"
            result.message = f"dvc exp run exited {proc.returncode}; last lines:\n" + "\n".join(tail[-12:])
        else:
            _finish(repo, copy, result)
    except Exception as exc:  # noqa: BLE001 - a trial that cannot start is a failed trial, not a failed sweep
        result.state, result.message = "failed", f"{type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(copy, ignore_errors=True)
        result.seconds = round(time.monotonic() - started, 1)
    return result


def _finish(repo: Path, copy: Path, result: TrialResult) -> None:
    history = read_json(copy / "reports" / "train_history.json")
    if not result.epochs:  # train came from DVC's run cache (these values ran before): its epochs from its history
        result.epochs = [float(r["val_accuracy"]) for r in history]
        result.restored = True
    best = (read_json(copy / "reports" / "train_run.json").get("best") or {}) if history else {}
    # model.pt holds the best epoch by train.monitor; with monitor val_loss, the objective is still accuracy
    kept = best.get("value") if best.get("metric") == "val_accuracy" else None
    result.val_accuracy = float(kept) if kept is not None else max(r["val_accuracy"] for r in history)
    metrics = read_json(copy / "reports" / "metrics.json")
    result.test_accuracy = float(metrics["accuracy"])
    gate = copy / "reports" / "gate.json"
    result.verdict = read_json(gate).get("verdict") if gate.is_file() else None
    if fetch_experiment(repo, copy, result.name) is None:
        raise RuntimeError(f"dvc exp run finished but left no experiment ref named {result.name}")
    result.state = "complete"
    result.message = f"validation accuracy {result.val_accuracy:.4f}, test accuracy {result.test_accuracy:.4f}"
