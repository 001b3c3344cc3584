"""DDP: `python -m tasks.train` with train.nproc_per_node 2 relaunches itself under torchrun (gloo on
CPU): every sample once per epoch, ranks' weights identical, only rank 0 writes, accuracy close to one
process. The nccl variant needs two CUDA devices (marked gpu)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tasks.core.io import read_json
from tests.helpers.project import env_with_venv, preprocessed_project, run_train

# Two torchrun jobs of several epochs (about 110 s): make test-slow. The default suite keeps DDP's mechanics
# with real gloo ranks: tests/training/test_consistency.py and the gradient test in test_memory_format.py.
pytestmark = pytest.mark.slow

# Both runs should learn the colour classes of preprocessed_project, so their accuracies are comparable. The
# default recipe (SGD, lr auto); the memory format is set per test, both ways.
TRAIN = {
    "arch": "resnet18",
    "epochs": 4,
    "batch_size": 16,
    "threads": 1,
}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return preprocessed_project(tmp_path_factory.mktemp("ddp"), TRAIN)


def configured_copy(prepared: Path, dest: Path, **train: Any) -> Path:
    repo = shutil.copytree(prepared, dest, symlinks=True)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["train"].update(train)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return repo


def train_copy(prepared: Path, dest: Path, **train: Any) -> tuple[Path, subprocess.CompletedProcess[str]]:
    repo = configured_copy(prepared, dest, **train)
    proc = subprocess.run([sys.executable, "-m", "tasks.train"], cwd=repo, env=env_with_venv(),
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return repo, proc


def check_two_process_run(repo: Path, one: Path, proc: subprocess.CompletedProcess[str]) -> None:
    meta = read_json(repo / "reports" / "train_run.json")
    assert meta["processes"] == 2 and meta["micro_batch"] == 8 and meta["global_batch"] == 16
    assert meta["ranks_in_sync"] is True
    single = read_json(one / "reports" / "train_run.json")
    assert meta["steps_per_epoch"] == single["steps_per_epoch"]  # the global batch is the same
    for epoch in meta["coverage"]:  # all ranks together: every used sample exactly once per epoch
        assert epoch["seen_once"] == meta["steps_per_epoch"] * 16 and epoch["seen_more_than_once"] == 0
    assert proc.stdout.count("[train] model -> ") == 1  # rank 0 alone writes and reports
    (run_dir,) = (repo / "runs" / "train").iterdir()
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1
    (ckpt_dir,) = (repo / "runs" / "checkpoints").iterdir()
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["best.pt", "identity.json", "last.pt"]
    # The model that ships (model.pt, the last epoch), scored on the val split: one process and two must both have
    # learned the colour classes. A DDP that averaged wrong gradients or skipped samples would not.
    one_last, two_last = (read_json(r / "reports" / "train_history.json")[-1]["val_accuracy"] for r in (one, repo))
    print(f"shipped model.pt val accuracy: one process {one_last:.4f}, two {two_last:.4f} ({meta['memory_format']})")
    assert one_last >= 0.9 and two_last >= 0.9 and abs(two_last - one_last) <= 0.1, (one_last, two_last)


@pytest.mark.parametrize("memory_format", ["contiguous", "channels_last"])
def test_two_processes_on_cpu_match_one(prepared: Path, tmp_path: Path, memory_format: str) -> None:
    one, _ = train_copy(prepared, tmp_path / "one", nproc_per_node=1, device="cpu", memory_format=memory_format)
    two, proc = train_copy(prepared, tmp_path / "two", nproc_per_node=2, device="cpu", memory_format=memory_format)
    assert "2 process(es), global batch 16 = 8 x 1 accumulation x 2" in proc.stdout
    assert read_json(two / "reports" / "train_run.json")["memory_format"] == memory_format
    check_two_process_run(two, one, proc)


# Two processes, global batch 16; a checkpoint every 2 steps and at each epoch's end.
RESUME = {"arch": "mobilenet_v3_small", "epochs": 2, "checkpoint_every_steps": 2, "nproc_per_node": 2, "device": "cpu"}


def test_killed_two_process_run_resumes_to_the_same_weights(prepared: Path, tmp_path: Path) -> None:
    plain, _ = train_copy(prepared, tmp_path / "plain", **RESUME)
    steps = read_json(plain / "reports" / "train_run.json")["steps_per_epoch"]
    repo = configured_copy(prepared, tmp_path / "killed", **RESUME)
    killed = run_train(repo, f"kill@step:{steps + 3}")  # every rank: mid-epoch 2, before its third step
    assert killed.returncode != 0 and not (repo / "models" / "model.pt").exists(), killed.stdout[-2000:]
    (ckpt_dir,) = (repo / "runs" / "checkpoints").iterdir()
    step = torch.load(ckpt_dir / "last.pt", weights_only=True)["progress"]["step"]
    assert steps < step < steps + 3  # a mid-epoch checkpoint, written before any rank ran on
    resumed = run_train(repo)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "resuming from" in resumed.stdout and f"step {step} of {2 * steps}" in resumed.stdout, resumed.stdout
    assert read_json(repo / "reports" / "train_run.json")["ranks_in_sync"] is True
    assert (repo / "models" / "model.pt").read_bytes() == (plain / "models" / "model.pt").read_bytes()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl DDP needs two CUDA devices")
def test_two_processes_with_nccl_match_one(prepared: Path, tmp_path: Path) -> None:
    one, _ = train_copy(prepared, tmp_path / "one", nproc_per_node=1, device="cuda")
    two, proc = train_copy(prepared, tmp_path / "two", nproc_per_node=2, device="cuda")
    assert "bf16 on cuda:0, 2 process(es)" in proc.stdout or "fp16 on cuda:0, 2 process(es)" in proc.stdout
    check_two_process_run(two, one, proc)
