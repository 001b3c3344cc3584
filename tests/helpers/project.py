"""Throwaway copies of the project as real git + DVC repositories, tiny params, and subprocess helpers."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.helpers.faults import fault_env
from tests.helpers.folders import make_imagefolder

ROOT = Path(__file__).resolve().parents[2]


PROJECT_FILES = ("tasks", "flows", "baseline", "models/pretrained", "models/parent", "dvc.yaml", "params.yaml")
# A promoted baseline, tracked weights and a warm-start parent stay behind: a test project starts with none
NOT_COPIED = ("__pycache__", "metrics.json", "model.json", "test_set.json", "decision.json", "*.onnx", "*.dvc", "*.pt",
              "parent.json")  # fmt: skip


# A run small enough for a test: 10 x 12 generated images at 32 px, one short epoch.
TINY = {
    "generate": {"images_per_class": 12, "min_side": 24, "max_side": 64, "workers": 1},
    "preprocess": {"image_size": 32, "workers": 1, "val_fraction": 0.2, "test_fraction": 0.2},
    # No flip probe: on a tiny folder whose mirror check only hints it trains 2 x 300 steps (about 100 s of a
    # 2-core machine) before a 1-epoch run; tests/training/test_flip_probe.py tests it with params of its own.
    "train": {
        "epochs": 1,
        "batch_size": 16,
        "lr": 0.01,
        "warmup_epochs": 0.5,
        "threads": 1,
        "recipe": {"flip_probe_steps": 0},
    },
    # A model trained for one short epoch has large, unsettled logits; fp32 rounding differences
    # between PyTorch and onnxruntime scale with them. It is also near chance, with near-tied logits
    # that INT8 rounding flips: on ~20 test images one flip is 5 points. (INT8 gates at their
    # defaults are tested on a trained model in tests/stages/test_export.py.)
    "export": {
        # The served model only: each export of INT8 and TorchScript cost a tiny project about 6 s of its 16.
        # Every format: tests/stages/test_export.py (tests/helpers/export.py) and train-flow's fixture.
        "formats": ["onnx"],
        "max_abs_diff": 0.01,
        "int8": {"max_accuracy_drop": 0.25, "min_agreement": 0.5},
        "timing": {"repeats": 3},
    },
    # The experiment table costs each gate an MLflow import and a write; the tests of the table turn it on
    # (tests/test_pipeline.py, tests/flows/test_flow.py, tests/flows/test_sweep.py, tests/release/).
    "tracking": {"enabled": False},
}


def deep_update(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        out[key] = deep_update(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def env_with_venv() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_train(repo: Path, fault: str | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """`python -m tasks.train` in `repo`, with the faults of `fault` planted (tests/helpers/faults.py) or none.
    Under DDP every rank sees it: the whole job dies, as on a preempted node."""
    env = env_with_venv()
    env.pop("IMAGEPIPE_FAULT", None)
    env.pop("IMAGEPIPE_TRAIN_HOOKS", None)
    env.update(fault_env(fault))
    return subprocess.run([sys.executable, "-m", "tasks.train"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def make_command(*args: str) -> list[str]:
    """`make <args>` with the project's Makefile, this interpreter's venv and the checkout's serving venv
    (`make test` builds it), for a copy or clone of the project run from its own folder (a test
    project has no venvs of its own, nor the requirements files to build them)."""
    venv = Path(sys.executable).parent.parent
    return ["make", "-s", "-f", str(ROOT / "Makefile"), f"VENV={venv}", f"BIN={venv}/bin", "STAMP=",
            f"SERVE_VENV={ROOT / '.venv-serve'}", "SERVE_STAMP=", *args]  # fmt: skip


def sh(args: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, cwd=cwd, env=env_with_venv(), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


def commit(repo: Path, message: str, *, allow_empty: bool = False) -> None:
    sh(["git", "add", "-A"], cwd=repo)
    empty = ["--allow-empty"] if allow_empty else []
    sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message, *empty], cwd=repo)


def dvc(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    return sh([sys.executable, "-m", "dvc", *args], cwd=cwd, check=check)


def stale_stages(repo: Path) -> dict[str, Any]:
    """`dvc status --json` without the "always changed" of the environment stage and the gate: they run on
    every `dvc repro` (the machine check; the verdict's enforcement), so DVC always lists them. {} means
    nothing else is left for `dvc repro` to do."""
    status = json.loads(dvc("status", "--json", cwd=repo).stdout or "{}")
    for stage in ("environment", "check_regression"):
        if status.get(stage) == ["always changed"]:
            del status[stage]
    return status


def ran_stages(output: str) -> list[str]:
    """The stages a `dvc repro` ran, from its output (the environment stage runs every time)."""
    return re.findall(r"Running stage '([^']+)'", output)


def write_params(repo: Path, update: dict[str, Any]) -> None:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    (repo / "params.yaml").write_text(yaml.safe_dump(deep_update(params, update), sort_keys=False))


def make_project(dest: Path, update: dict[str, Any] | None = None) -> Path:
    """A copy of the project as a fresh git + DVC repository, with params shrunk by `update`."""
    dest.mkdir(parents=True)
    for name in PROJECT_FILES:
        src = ROOT / name
        if src.is_dir():
            # A promoted baseline (make promote: metrics, model.json, model.onnx, their .dvc files) stays
            # behind, so every test project starts with no baseline.
            shutil.copytree(
                src,
                dest / name,  # models/pretrained, models/parent: their READMEs only (no weights in a test project)
                ignore=shutil.ignore_patterns(*NOT_COPIED),
            )
        else:
            shutil.copy2(src, dest / name)
    write_params(dest, deep_update(TINY, update or {}))
    # the experiment table and its writer lock, and bytecode, as the project ignores them
    (dest / ".gitignore").write_text("mlflow.db\nmlflow.db.lock\nmlartifacts/\n__pycache__/\n*.pyc\n")
    sh(["git", "init", "-q"], cwd=dest)
    dvc("init", "-q", cwd=dest)
    # the project's, not `dvc init`'s: the bytecode Python writes beside tasks/ is no part of a stage's deps (without
    # it, where PYTHONDONTWRITEBYTECODE is unset, every stage's code deps change as it runs, and every repro reruns all)
    shutil.copy2(ROOT / ".dvcignore", dest / ".dvcignore")
    dvc("config", "core.analytics", "false", cwd=dest)
    return dest


def preprocessed_project(root: Path, train: dict[str, Any]) -> Path:
    """A project on a drawn 3-class folder of 40 images per class (told apart by colour), its shards made,
    with `train` params: the starting point of the DDP and multi-node tests."""
    source = make_imagefolder(root / "images", classes=3, per_class=40)
    repo = make_project(root / "repo", {"data": {"source": str(source)}, "train": train})
    dvc("repro", "preprocess", cwd=repo)
    return repo
