"""The adapter over DVC's and torch's private APIs (tasks/core/private_api.py): each wrapper still does
what the project relies on, with the versions constraints.txt pins. An upgrade that changes one fails here.

Also: no module outside the adapter touches those private names."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from tasks.core import private_api
from tests.helpers.project import ROOT, dvc, sh

pytestmark = pytest.mark.fast  # unit-level: make test-fast

PRIVATE = ("_wait_for_lock", "modify_yaml", "apply_overrides", "_is_avx512_bf16_supported", "_is_amx_tile_supported")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    sh(["git", "init", "-q"], cwd=tmp_path)
    dvc("init", "-q", cwd=tmp_path)
    (tmp_path / "params.yaml").write_text("# the knobs\ntrain:\n  lr: 0.1  # head lr\n  arch: resnet18\nseed: 7\n")
    (tmp_path / "dvc.yaml").write_text("stages:\n  s:\n    cmd: cp params.yaml out.txt\n    deps: [params.yaml]\n"
                                       "    params: [seed]\n    outs: [out.txt]\n")  # fmt: skip
    return tmp_path


def test_set_params_writes_like_dvc_exp_run_keeping_comments_and_other_bytes(repo: Path) -> None:
    before = (repo / "params.yaml").read_text()
    private_api.set_params(repo / "params.yaml", ["seed=7"])  # already so: not one byte moves
    assert (repo / "params.yaml").read_text() == before
    private_api.set_params(repo / "params.yaml", ["train.lr=0.02", "train.arch=resnet34"])
    text = (repo / "params.yaml").read_text()
    assert "# the knobs" in text and "# head lr" in text
    assert yaml.safe_load(text) == {"train": {"lr": 0.02, "arch": "resnet34"}, "seed": 7}


def test_edit_yaml_round_trips_comments_and_key_order(repo: Path) -> None:
    with private_api.edit_yaml(repo / "params.yaml") as doc:
        doc["train"]["arch"] = "resnet34"
        doc["added"] = {"x": 1}
    text = (repo / "params.yaml").read_text()
    assert text.startswith("# the knobs\ntrain:\n  lr: 0.1  # head lr\n  arch: resnet34\nseed: 7\nadded:")


def test_dvc_stage_status_is_what_the_cli_prints(repo: Path) -> None:
    cli = json.loads(dvc("status", "--json", "s", cwd=repo).stdout or "{}").get("s", [])
    assert private_api.dvc_stage_status(repo, "s") == cli and cli  # never run: its out is missing
    dvc("repro", "-q", "s", cwd=repo)
    assert private_api.dvc_stage_status(repo, "s") == [] == json.loads(dvc("status", "--json", "s", cwd=repo).stdout
                                                                         or "{}").get("s", [])  # fmt: skip


def test_dvc_repo_waits_for_the_lock_where_the_cli_gives_up(repo: Path) -> None:
    released, held = [], threading.Event()

    def hold() -> None:
        with private_api.dvc_locked(repo):
            held.set()
            time.sleep(4)
            released.append(time.monotonic())

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(60)
    cli = subprocess.run([sys.executable, "-m", "dvc", "status", "s"], cwd=repo, capture_output=True, text=True)
    assert cli.returncode != 0 and "lock" in (cli.stderr + cli.stdout).lower()  # without waiting: refused
    entries = private_api.dvc_stage_status(repo, "s")  # waits until the holder lets go
    done = time.monotonic()
    holder.join()
    assert released and done >= released[0] and entries


def test_dvc_busy_sees_a_dvc_repro_while_its_stage_runs(repo: Path) -> None:
    """DVC lets go of its repository lock while a stage's command runs (a take-in checking only that lock would
    pass in the middle of training); the stage's rwlock entries say it is at work."""
    (repo / "dvc.yaml").write_text("stages:\n  slow:\n    cmd: python -c \"import time; open('started', 'w'); "
                                   "time.sleep(6); open('out.txt', 'w')\"\n    outs: [out.txt]\n")  # fmt: skip
    assert private_api.dvc_busy(repo) is None
    proc = subprocess.Popen([sys.executable, "-m", "dvc", "repro"], cwd=repo, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (repo / "started").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the stage never started"
            time.sleep(0.1)
        busy = private_api.dvc_busy(repo)
        assert busy is not None and busy.startswith(f"pid {proc.pid} (") and "repro" in busy, busy
    finally:
        assert proc.wait(timeout=60) == 0
    assert private_api.dvc_busy(repo) is None  # done: nothing holds either lock
    with private_api.dvc_locked(repo):  # the repository lock alone (DVC writing its state) counts too
        assert private_api.dvc_busy(repo) is not None


def test_dvc_remotes_reads_the_config(repo: Path, tmp_path: Path) -> None:
    assert private_api.dvc_remotes(repo) == ({}, None)
    dvc("remote", "add", "backup", str(tmp_path / "b"), cwd=repo)
    dvc("remote", "add", "-d", "storage", str(tmp_path / "s"), cwd=repo)
    remotes, default = private_api.dvc_remotes(repo)
    assert default == "storage" and set(remotes) == {"backup", "storage"}
    assert Path(remotes["storage"]).resolve() == (tmp_path / "s").resolve()


def test_cpu_native_bf16_matches_the_cpu_flags() -> None:
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])  # fmt: skip
    native = "avx512_bf16" in flags or "amx_tile" in flags
    assert private_api.cpu_native_bf16() is native
    assert callable(torch.cpu._is_avx512_bf16_supported)  # the names the adapter calls still exist


def test_no_module_outside_the_adapter_touches_a_private_api() -> None:
    adapter = ROOT / "tasks" / "core" / "private_api.py"
    found = []
    for folder in ("tasks", "flows", "serving", "scripts", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == adapter:
                continue
            names = {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)}
            names |= {a.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)
                      for a in n.names}  # fmt: skip
            names |= {k.arg for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)
                      for k in n.keywords if k.arg}  # fmt: skip
            found += [f"{path.relative_to(ROOT)}: {name}" for name in sorted(names & set(PRIVATE))]
    assert found == []
