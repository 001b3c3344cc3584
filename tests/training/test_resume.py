"""Kill -9 the train stage at three points, rerun it: it resumes from its last checkpoint and ends with
the same model.pt bytes as an uninterrupted run. Real processes, real SIGKILL, real DVC."""

from __future__ import annotations

import hashlib
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.faults import fault_env
from tests.helpers.project import dvc, env_with_venv, make_project, run_train

# 69 training images, global batch 16: 4 steps per epoch, 8 in all; checkpoints after steps 2 (mid-epoch),
# 4 (epoch end), 6 (mid-epoch) and 8 (end). mobilenet_v3_small: small checkpoints, and its dropout draws
# from the global torch RNG, so a resume that did not restore it would end with other weights. train.ema: model.pt
# holds the average of the weights, so a resume that lost the average (or its count) would end with other bytes.
UPDATE = {"train": {"arch": "mobilenet_v3_small", "epochs": 2, "checkpoint_every_steps": 2, "device": "cpu",
                    "ema": True, "ema_decay": 0.5}}  # fmt: skip


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def checkpoints(repo: Path) -> Path:
    (run_dir,) = (repo / "runs" / "checkpoints").iterdir()
    return run_dir


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = make_project(tmp_path_factory.mktemp("resume") / "repo", UPDATE)
    dvc("repro", "preprocess", cwd=repo)
    return repo


@pytest.fixture(scope="module")
def uninterrupted(prepared: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    repo = shutil.copytree(prepared, tmp_path_factory.mktemp("plain") / "repo", symlinks=True)
    proc = run_train(repo)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resuming" not in proc.stdout
    return md5(repo / "models" / "model.pt")


def copy_of(prepared: Path, tmp_path: Path) -> Path:
    return shutil.copytree(prepared, tmp_path / "repo", symlinks=True)


@pytest.mark.slow  # 30 s; the two kills below resume in the default suite
def test_kill_mid_epoch_under_dvc_repro_resumes(prepared: Path, uninterrupted: str, tmp_path: Path) -> None:
    repo = copy_of(prepared, tmp_path)
    killed = subprocess.run([sys.executable, "-m", "dvc", "repro", "train"], cwd=repo, capture_output=True,
                            text=True, env={**env_with_venv(), **fault_env("kill@step:3")})  # fmt: skip
    # DVC runs the command through $SHELL: -9 if that shell exec'd python, 137 (128+SIGKILL) if it forked it
    assert re.search(r"exited with (-9|137)\b", killed.stderr), killed.stderr[-2000:]
    assert not (repo / "models" / "model.pt").exists()
    assert torch.load(checkpoints(repo) / "last.pt", weights_only=True)["progress"]["step"] == 2
    rerun = dvc("repro", "train", cwd=repo)  # the checkpoint folder survives dvc repro
    assert "resuming from" in rerun.stdout and "step 2 of 8 (epoch 1, batch 2 of 4)" in rerun.stdout
    assert md5(repo / "models" / "model.pt") == uninterrupted


def test_kill_right_after_a_checkpoint_resumes_from_it(prepared: Path, uninterrupted: str, tmp_path: Path) -> None:
    repo = copy_of(prepared, tmp_path)
    killed = run_train(repo, "kill@after-ckpt:3")  # the checkpoint of step 6 is on disk, then SIGKILL
    assert killed.returncode == -signal.SIGKILL
    rerun = run_train(repo)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "step 6 of 8 (epoch 2, batch 2 of 4)" in rerun.stdout
    assert md5(repo / "models" / "model.pt") == uninterrupted


@pytest.mark.slow  # the default suite's budget (issue 59 item 4): make test-slow runs it
def test_kill_during_a_checkpoint_write_keeps_the_previous_one(
    prepared: Path, uninterrupted: str, tmp_path: Path
) -> None:
    repo = copy_of(prepared, tmp_path)
    killed = run_train(repo, "kill@ckpt-write:2")  # half-way through writing the checkpoint of step 4
    assert killed.returncode == -signal.SIGKILL
    run_dir = checkpoints(repo)
    (partial,) = run_dir.glob(".last.pt.tmp-*")
    assert partial.stat().st_size > 0
    assert torch.load(run_dir / "last.pt", weights_only=True)["progress"]["step"] == 2  # the previous one loads
    rerun = run_train(repo)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "step 2 of 8 (epoch 1, batch 2 of 4)" in rerun.stdout
    assert md5(repo / "models" / "model.pt") == uninterrupted
    assert not partial.exists() and sorted(p.name for p in run_dir.iterdir()) == ["best.pt", "identity.json", "last.pt"]


@pytest.mark.slow
def test_external_kill_at_random_moments(prepared: Path, uninterrupted: str, tmp_path: Path) -> None:
    """`kill -9` from outside, at whatever moment a checkpoint has just appeared, three times in a row."""
    repo = copy_of(prepared, tmp_path)
    for _ in range(3):
        env = env_with_venv()
        proc = subprocess.Popen([sys.executable, "-m", "tasks.train"], cwd=repo, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        folder = repo / "runs" / "checkpoints"
        before = {p: p.stat().st_mtime_ns for p in folder.glob("*/last.pt")}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            now = {p: p.stat().st_mtime_ns for p in folder.glob("*/last.pt")}
            if now and now != before:
                break
            time.sleep(0.05)
        time.sleep(0.3)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    final = run_train(repo)
    assert final.returncode == 0, final.stderr[-2000:]
    assert md5(repo / "models" / "model.pt") == uninterrupted
