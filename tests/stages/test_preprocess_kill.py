"""SIGKILL the preprocess stage at several points, rerun it: byte-identical to a clean run, and a
half-written shard is never listed (the shard directory is either the previous complete one or
the new complete one, and every shard it lists matches its checksum)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tasks import preprocess
from tasks.core.params import load_params
from tasks.images.shards import SPLITS, ShardSplit
from tests.helpers.folders import make_imagefolder
from tests.helpers.project import ROOT, env_with_venv, write_params

UPDATE = {"preprocess": {"image_size": 16, "workers": 1, "shard_size": 8, "val_fraction": 0.1, "test_fraction": 0.1}}


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def temps(parent: Path) -> list[Path]:
    return sorted(parent.glob(".shards.*"))


def arrow_files_in_temp(parent: Path) -> int:
    return sum(len(list(t.glob("*.arrow"))) for t in temps(parent) if t.is_dir())


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory with params.yaml pointing at a 450-image folder; shards go to data/shards."""
    work = tmp_path_factory.mktemp("kill")
    make_imagefolder(work / "images", classes=3, per_class=150, seed=5)
    write_params(work, {**UPDATE, "data": {"source": str(work / "images")}})
    return work


def start_stage(work: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tasks.preprocess"],
        cwd=work,
        env={**env_with_venv(), "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: the decoder workers can be killed with it
    )


def kill_when(proc: subprocess.Popen[bytes], ready: Callable[[], bool], timeout: float = 120) -> bool:
    """SIGKILL the stage as soon as `ready()` holds; False if it finished first."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if ready():
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.001)
    fired = proc.poll() is None or proc.returncode == -signal.SIGKILL
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # orphaned workers of the killed stage, if any are left
    proc.wait()
    return fired and proc.returncode == -signal.SIGKILL


def rerun(work: Path) -> None:
    params = load_params(work / "params.yaml")
    preprocess.run(params.preprocess, seed=params.seed, source=params.data.source, out_dir=work / "data" / "shards")


def assert_complete_and_verified(shards: Path, allowed: list[dict[str, bytes]]) -> None:
    if not shards.exists():
        assert {} in allowed, "the previous complete output disappeared"
        return
    assert tree_bytes(shards) in allowed, "the shard directory is neither the old nor the new complete output"
    for split in SPLITS:
        ShardSplit.open(shards, split, verify=True)  # every listed shard exists and matches its sha256


def test_sigkill_at_any_point_then_rerun_gives_identical_shards(project: Path, tmp_path: Path) -> None:
    data = project / "data"
    params = load_params(project / "params.yaml")
    preprocess.run(params.preprocess, seed=params.seed, source=params.data.source, out_dir=tmp_path / "clean")
    clean = tree_bytes(tmp_path / "clean")
    preprocess.run(params.preprocess, seed=params.seed + 1, source=params.data.source, out_dir=tmp_path / "old")
    previous = tree_bytes(tmp_path / "old")  # a complete earlier output, with other bytes
    assert previous != clean

    start = time.monotonic()
    shutil.rmtree(data, ignore_errors=True)
    proc = start_stage(project)
    proc.wait()
    assert proc.returncode == 0 and tree_bytes(data / "shards") == clean
    full = time.monotonic() - start

    points: dict[str, Callable[[float], Callable[[], bool]]] = {
        "while starting": lambda t0: lambda: time.monotonic() - t0 > 0.3,
        "temp dir just made": lambda t0: lambda: bool(temps(data)),
        "first shard being written": lambda t0: lambda: arrow_files_in_temp(data) >= 1,
        "deep into the shards": lambda t0: lambda: arrow_files_in_temp(data) >= 30,
        "writing the manifest": lambda t0: lambda: any((t / "manifest.json").exists() for t in temps(data)),
        "late, by the clock": lambda t0: lambda: time.monotonic() - t0 > 0.95 * full,
    }
    late = ("deep into the shards", "writing the manifest", "late, by the clock")
    fired = []
    for with_previous in (False, True):
        for name, point in points.items():
            if with_previous and name not in late:  # an old output only matters once the swap is near
                continue
            shutil.rmtree(data, ignore_errors=True)
            if with_previous:
                shutil.copytree(tmp_path / "old", data / "shards")
            proc = start_stage(project)
            if kill_when(proc, point(time.monotonic())):
                fired.append(name)
            assert_complete_and_verified(data / "shards", [clean, previous] if with_previous else [clean, {}])
            rerun(project)
            assert tree_bytes(data / "shards") == clean, f"rerun after a kill {name} differs from a clean run"
            assert temps(data) == [], f"stale temporary directories left after a kill {name}: {temps(data)}"
    # The wide windows must really have been hit, or this test tested nothing.
    for name in ("temp dir just made", "first shard being written", "deep into the shards"):
        assert name in fired, f"never killed {name}: {fired}"
