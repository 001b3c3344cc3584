"""Training across nodes: two "nodes" on this machine, each a checkout of its own with one process,
started the way a multi-node job is (`dvc repro train` on the head, `make train-join` on the other:
torchrun with c10d rendezvous flags at 127.0.0.1), the checkpoint folder shared. The weights equal a
one-node, two-process run's; DVC on the head records the result; a node lost mid-epoch stops the job
with a clear message, and the rerun resumes to the same weights."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tasks.core.io import read_json
from tests.helpers.faults import fault_env
from tests.helpers.prefect import free_port
from tests.helpers.project import dvc, env_with_venv, make_command, preprocessed_project

pytestmark = pytest.mark.slow

# Two processes in all, global batch 16; a checkpoint every 2 steps and at each epoch's end; one torch
# thread per process in both layouts, so the arithmetic is the same.
TRAIN = {"arch": "mobilenet_v3_small", "epochs": 2, "batch_size": 16, "optimizer": "adamw", "lr": 0.001,
         "threads": 1, "device": "cpu", "checkpoint_every_steps": 2}  # fmt: skip


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return preprocessed_project(tmp_path_factory.mktemp("multinode"), TRAIN)


def configure(repo: Path, **update: Any) -> Path:
    params = yaml.safe_load((repo / "params.yaml").read_text())
    for section, values in update.items():
        params[section].update(values)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return repo


def weights(model_file: Path) -> dict[str, torch.Tensor]:
    return torch.load(model_file, map_location="cpu", weights_only=True)["state_dict"]


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


class Nodes:
    """A head checkout and a joining one, both pointed at one rendezvous and one checkpoint folder."""

    def __init__(self, prepared: Path, root: Path) -> None:
        shared = root / "shared-checkpoints"
        self.port = free_port()
        node = {"train": {"nnodes": 2, "nproc_per_node": 1, "rdzv_endpoint": f"127.0.0.1:{self.port}",
                          "rdzv_timeout_s": 120}, "paths": {"checkpoints": str(shared)}}  # fmt: skip
        self.head = configure(shutil.copytree(prepared, root / "head", symlinks=True), **node)
        self.other = configure(shutil.copytree(prepared, root / "other", symlinks=True), **node)
        self.shared = shared

    def run(self, fault_on_other: str | None = None) -> tuple[subprocess.CompletedProcess[str], str]:
        """The other node first (its rendezvous rank is then 0, so the head-first renumbering is
        exercised), then the head's `dvc repro train`; returns the head's result and the other's output."""
        env = env_with_venv()
        env.pop("IMAGEPIPE_FAULT", None)
        env.pop("IMAGEPIPE_TRAIN_HOOKS", None)
        other_env = {**env, **fault_env(fault_on_other)}
        log = (self.other / "join.log").open("w")
        joining = subprocess.Popen(make_command("train-join"), cwd=self.other, env=other_env, stdout=log,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
        try:
            time.sleep(1.0)
            head = subprocess.run([sys.executable, "-m", "dvc", "repro", "train"], cwd=self.head, env=env,
                                  capture_output=True, text=True, timeout=600)  # fmt: skip
            joining.wait(timeout=120)
        finally:
            if joining.poll() is None:
                os.killpg(joining.pid, signal.SIGKILL)
            log.close()
        return head, (self.other / "join.log").read_text()


def test_two_nodes_match_one_node_with_two_processes_and_dvc_records_it(prepared: Path, tmp_path: Path) -> None:
    one = configure(shutil.copytree(prepared, tmp_path / "one", symlinks=True), train={"nproc_per_node": 2})
    proc = subprocess.run([sys.executable, "-m", "tasks.train"], cwd=one, env=env_with_venv(),
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    nodes = Nodes(prepared, tmp_path / "nodes")
    head, other = nodes.run()
    assert head.returncode == 0, head.stdout[-4000:] + head.stderr[-4000:] + other[-3000:]
    assert "head node of 2, 1 process(es) each" in head.stdout
    assert "joining as another node of 2" in other and "model -> " not in other and "epoch 1:" not in other
    # Only global rank 0 writes, and it is on the head: the other checkout has no outputs at all.
    assert same_weights(nodes.head / "models" / "model.pt", one / "models" / "model.pt")
    assert not (nodes.other / "models" / "model.pt").exists()
    assert not (nodes.other / "reports" / "train_run.json").exists()
    meta = read_json(nodes.head / "reports" / "train_run.json")
    assert meta["processes"] == 2 and meta["ranks_in_sync"] is True
    # DVC on the head recorded it: no `dvc commit` by hand, nothing left to run.
    lock = yaml.safe_load((nodes.head / "dvc.lock").read_text())
    assert lock["stages"]["train"]["params"]["params.yaml"]["train"]["nnodes"] == 2
    status = dvc("status", "train", "--json", cwd=nodes.head).stdout
    assert yaml.safe_load(status) == {}, status
    (ckpt_dir,) = nodes.shared.iterdir()  # the one shared checkpoint folder
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["best.pt", "identity.json", "last.pt"]


def test_a_node_lost_mid_epoch_stops_both_and_the_rerun_resumes_to_the_same_weights(
    prepared: Path, tmp_path: Path
) -> None:
    plain = Nodes(prepared, tmp_path / "plain")
    head, other = plain.run()
    assert head.returncode == 0, head.stdout[-4000:] + head.stderr[-4000:] + other[-3000:]
    steps = read_json(plain.head / "reports" / "train_run.json")["steps_per_epoch"]

    nodes = Nodes(prepared, tmp_path / "lost")
    head, other = nodes.run(fault_on_other=f"kill@step:{steps + 3}")  # the other node dies mid-epoch 2
    assert head.returncode != 0 and not (nodes.head / "models" / "model.pt").exists()
    assert "lost contact with another rank" in head.stderr and "resumes from the last checkpoint" in head.stderr, (
        head.stdout[-3000:] + head.stderr[-3000:]
    )
    assert "torchrun exited with status" in other and "joining node" in other, other[-3000:]
    (ckpt_dir,) = nodes.shared.iterdir()
    step = torch.load(ckpt_dir / "last.pt", weights_only=True)["progress"]["step"]
    assert steps < step < steps + 3  # mid-epoch: the last step that every rank reached

    configure(nodes.other, paths={"checkpoints": str(tmp_path / "not-shared")})  # a folder of its own
    head, other = nodes.run()
    assert head.returncode != 0 and "must be one folder that every node sees" in head.stderr, head.stderr[-3000:]
    assert "rank 1 (" in head.stderr and "does not see .shared-" in head.stderr, head.stderr[-3000:]

    configure(nodes.other, paths={"checkpoints": str(nodes.shared)})
    head, other = nodes.run()
    assert head.returncode == 0, head.stdout[-4000:] + head.stderr[-4000:] + other[-3000:]
    assert f"step {step} of {2 * steps}" in head.stdout and "resuming from" in head.stdout, head.stdout[-3000:]
    assert same_weights(nodes.head / "models" / "model.pt", plain.head / "models" / "model.pt")


def test_a_node_with_other_params_is_refused_by_name(prepared: Path, tmp_path: Path) -> None:
    nodes = Nodes(prepared, tmp_path / "nodes")
    configure(nodes.other, train={"lr": 0.002})  # another commit's params on the joining node
    head, other = nodes.run()
    assert head.returncode != 0
    assert "rank 1" in head.stderr + other and "other params_sha256 than rank 0" in head.stderr + other, (
        head.stderr[-3000:] + other[-3000:]
    )
