"""One sweep trial: a DVC experiment (`dvc exp run -n <name> -S key=value ...`) in its own temporary copy.

The copy is a `git clone --shared` of this repository at its HEAD commit, in a folder of its own under
runs/sweep/<study>/, sharing this workspace's DVC cache (flows/scratch.py; hard links where the file system
allows): the committed run's outputs come from the cache, so only train and what follows it run, and what the
trial makes lands in the same cache. Trials
never share a workspace, a dvc.lock or DVC's experiment refs (DVC's own queue with -j > 1 does, and has lost
experiments). A finished trial's experiment ref is fetched into this repository, so `dvc exp show` lists it
and `dvc exp apply <name>` applies it (its outputs are in the shared cache).

While it runs, each epoch's validation accuracy (the train stage's epoch record,
tasks/training/epoch_record.py) is handed to `report`; when that says prune, the trial's process group is
stopped and its folder removed: a pruned trial leaves no model.pt, no lock entry, no verdict and no experiment.
A trial whose process dies (kill -9 included) is a failed trial; the copy goes all the same, and the workspace
is never touched.
With the project's MLflow store a SQLite file, the trial's gate logs into a store of its own in the trial's
folder, which the sweep copies into the project's when the trial ends (flows/sweep/store.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml
from prefect import runtime

from flows.scratch import ProcessGroup, cache_dir, copy_local_config
from flows.shell import NOT_INHERITED, stage_env
from flows.sweep.space import set_args
from flows.sweep.store import Store
from tasks.core.io import read_json
from tasks.core.params import PARAMS_FILE, load_params
from tasks.release import run_record, tracking
from tasks.training.epoch_record import read_epoch_line

PROGRESS = re.compile(r"\d+%\|")  # a tqdm redraw
_FETCH = threading.Lock()  # one `git fetch` into this repository at a time
_LIVE: set[ProcessGroup] = set()  # the trials running now (stop_all stops them)
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
    where: str = ""  # a sweep over machines: the worker's host:checkout that ran it ("": this machine)


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True)


def _dvc(*args: str) -> list[str]:
    return [sys.executable, "-m", "dvc", *args]


def trial_env(uri: str | None, parent: str | None, tag: str) -> dict[str, str]:
    """The environment of a trial's `dvc exp run`: the project's, less the gate's switches and test hooks, with
    the MLflow store its gate logs to (None: the checkout's own), the sweep's parent run and the trial's tag."""
    env = stage_env(NOT_INHERITED)
    if uri:
        env["MLFLOW_TRACKING_URI"] = uri
    if parent:
        env[tracking.PARENT_ENV] = parent
    env[run_record.TRIAL_ENV] = tag
    with contextlib.suppress(Exception):  # outside a flow run there is none to name
        env["PREFECT__FLOW_RUN_ID"] = str(runtime.flow_run.id)
    return env


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
    copy_local_config(repo, copy)
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


def pull_inputs(copy: Path, remote: str | None, log: Callable[[str], None]) -> None:
    """`dvc pull` of the committed run in the trial's copy; what is still missing afterwards is named."""
    proc = _run(_dvc("pull", *(["--remote", remote] if remote else [])), copy)
    if proc.returncode == 0:
        log(f"inputs pulled from the DVC remote into {copy}")
        return
    lock = yaml.safe_load((copy / "dvc.lock").read_text()) if (copy / "dvc.lock").is_file() else {}
    outs = [o["path"] for stage in (lock.get("stages") or {}).values() for o in stage.get("outs", [])]
    missing = [path for path in outs if not (copy / path).exists()] or ["(see DVC's words)"]
    said = (proc.stderr or proc.stdout).strip().splitlines()
    raise RuntimeError(
        f"inputs missing on this worker: {', '.join(missing[:6])} (`dvc pull`: {said[-1][:300] if said else ''})"
    )


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
    """A killed sweep's trial folders: any process still working in one is killed, then the folder removed. Called
    under the study's lock, so no live sweep owns them. Returns the folders removed."""
    if not workdir.is_dir():
        return []
    folders = [p.resolve() for p in workdir.iterdir() if p.is_dir()]
    for proc in psutil.process_iter(["cwd"]):
        cwd = proc.info["cwd"]  # None where it cannot be read (another user's process, one that just ended)
        if cwd and any(Path(cwd).is_relative_to(f) for f in folders):
            with contextlib.suppress(psutil.Error):
                proc.kill()
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    return folders


def stop_all() -> int:
    """Stop every trial running now (a sweep interrupted with Ctrl-C): their process groups get SIGTERM, then
    SIGKILL. Each trial's thread then sees it failed and removes its copy. Returns how many were stopped."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for group in live:
        group.stop(grace_s=5.0)
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
    store: Store | None = None,
    pull: bool = False,
    dvc_remote: str | None = None,
) -> TrialResult:
    """Run the trial to its end, its pruning or its failure; fill in `result` and return it. `cores`: the CPUs
    its processes may use (trials that share a machine get disjoint ones; train.threads 0 then counts them).
    `store`: the project's MLflow store (None: the gate logs where `env` says). `pull`: on a worker of a sweep over
    machines, the committed run's outputs come from the DVC remote (`dvc_remote`, None: the default one)."""
    started = time.monotonic()
    workdir.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f"{result.name}-", dir=workdir))
    copy = folder / "repo"
    own = store.for_trial(folder / "mlflow") if store is not None else None
    if own is not None:
        env = {**env, "MLFLOW_TRACKING_URI": own}
    try:
        prepare_copy(repo, copy, commit, cache_dir(repo))
        if pull:
            pull_inputs(copy, dvc_remote, log)
        seed = ["-S", f"seed={result.seed}"] if result.seed is not None else []
        command = _dvc("exp", "run", "-n", result.name, *set_args(result.values), *seed, *(extra_sets or []))
        log(f"trial {result.name}: {' '.join(command[2:])}  (in {copy})")
        tail: list[str] = []
        pruned = False
        with ProcessGroup(command, cwd=copy, env=env, capture=True) as group:
            with _LIVE_LOCK:
                _LIVE.add(group)
            try:
                if cores:  # before dvc starts a thread or a stage: all of them inherit it
                    os.sched_setaffinity(group.pid, cores)
                for line in group.lines():
                    tail = [*tail[-29:], line]
                    record = read_epoch_line(line)  # the human line beside it is what the log shows
                    if record is None and (not PROGRESS.search(line) or "100%|" in line):  # a bar: its last redraw
                        log(f"[{result.name}] {line}")
                    if record is not None:
                        accuracy = float(record["val_accuracy"])
                        result.epochs.append(accuracy)
                        if report is not None and report(int(record["epoch"]), accuracy):
                            pruned = True
                            group.stop()
                            break
                returncode = group.wait()
            finally:
                with _LIVE_LOCK:
                    _LIVE.discard(group)
        if pruned:
            result.state = "pruned"
            result.message = f"pruned after epoch {len(result.epochs)} (validation accuracy {result.epochs[-1]:.4f})"
        elif returncode != 0:
            result.state = "failed"
            result.message = f"dvc exp run exited {returncode}; last lines:\n" + "\n".join(tail[-12:])
        else:
            _finish(repo, copy, result)
    except Exception as exc:  # noqa: BLE001 - a trial that cannot start is a failed trial, not a failed sweep
        result.state, result.message = "failed", f"{type(exc).__name__}: {exc}"
    finally:
        if own is not None and store is not None:  # what the gate logged, failed or not, before its folder goes
            store.merge(own)
        shutil.rmtree(folder, ignore_errors=True)
        result.seconds = round(time.monotonic() - started, 1)
    return result


def _finish(repo: Path, copy: Path, result: TrialResult) -> None:
    paths = load_params(copy / PARAMS_FILE).paths  # the trial's own params.yaml names its reports
    history = read_json(copy / paths.train_history)
    if not result.epochs:  # train came from DVC's run cache (these values ran before): its epochs from its history
        result.epochs = [float(r["val_accuracy"]) for r in history]
        result.restored = True
    best = (read_json(copy / paths.train_run).get("best") or {}) if history else {}
    # model.pt holds the best epoch by train.monitor; with monitor val_loss, the objective is still accuracy
    kept = best.get("value") if best.get("metric") == "val_accuracy" else None
    result.val_accuracy = float(kept) if kept is not None else max(r["val_accuracy"] for r in history)
    metrics = read_json(copy / paths.metrics)
    result.test_accuracy = float(metrics["accuracy"])
    gate = copy / paths.gate
    result.verdict = read_json(gate).get("verdict") if gate.is_file() else None
    if fetch_experiment(repo, copy, result.name) is None:
        raise RuntimeError(f"dvc exp run finished but left no experiment ref named {result.name}")
    result.state = "complete"
    result.message = f"validation accuracy {result.val_accuracy:.4f}, test accuracy {result.test_accuracy:.4f}"
