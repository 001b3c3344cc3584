"""Reproducible anywhere: the user's data under DVC, a run committed the DVC way, and a second machine
that has nothing but the git remote, the DVC remote and a Prefect server.

Machine 1 adds an ImageFolder with `make add-data`, runs, promotes, commits (`make commit-run`) and
pushes to a bare git repository and a local-directory DVC remote; then swaps one image and runs
again. Machine 2 is a separate clone with its own empty DVC cache: `git pull` + `dvc pull`, then
(a) `dvc status` is clean with nothing run, (b) `make serve` there serves the promoted baseline, hash-verified,
(c) regression-flow/nightly, run by a worker in that clone, scores the baseline and passes, and
(d) checking out the older commit and `dvc pull` restores that commit's shards and model byte for
byte, and `dvc repro` there is a no-op.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml
from dvc.utils.hydra import apply_overrides
from PIL import Image

from flows.artifacts import KEYS
from tasks.core.params import load_params
from tasks.images.splits import split_of
from tests.helpers.folders import make_imagefolder
from tests.helpers.prefect import Production, free_port, prefect_env
from tests.helpers.project import (
    ROOT,
    commit,
    dvc,
    env_with_venv,
    make_command,
    make_project,
    ran_stages,
    sh,
    stale_stages,
)

pytestmark = pytest.mark.slow


def make(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        make_command(*args), cwd=repo, env=env_with_venv(), capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, f"make {' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@contextmanager
def served(repo: Path) -> Iterator[str]:
    """`make serve` in `repo` on a free port of 127.0.0.1, until /ready answers 200; stopped afterwards."""
    port = free_port()
    apply_overrides(str(repo / "params.yaml"), [f"serve.port={port}"])  # not a stage param: dvc status stays clean
    proc = subprocess.Popen(make_command("serve"), cwd=repo, env=env_with_venv(), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            assert proc.poll() is None, "make serve exited"
            time.sleep(0.3)
        else:
            raise AssertionError("make serve: not ready within 90 s")
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        sh(["git", "checkout", "--", "params.yaml"], cwd=repo)


def md5s(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.md5(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


def lock_outs(repo: Path, stage: str) -> dict[str, str]:
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"][stage]
    return {out["path"]: out["md5"] for out in lock["outs"]}


def test_a_second_machine_pulls_serves_checks_and_goes_back_in_time(tmp_path: Path) -> None:
    origin = tmp_path / "origin.git"
    sh(["git", "init", "-q", "--bare", "-b", "main", str(origin)], cwd=tmp_path)
    storage = tmp_path / "dvc-storage"
    # A one-epoch model is near chance: run 2 (one image swapped) may score a few points either way.
    loose = [{"metric": "accuracy", "direction": "higher", "abs_tol": 1.0}]
    one = make_project(tmp_path / "machine1", {"regression": {"rules": loose}})
    shutil.copytree(ROOT / "scripts", one / "scripts")
    shutil.copytree(ROOT / "serving", one / "serving", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "prefect.yaml", one / "prefect.yaml")
    (one / ".gitignore").write_text((ROOT / ".gitignore").read_text())
    dvc("remote", "add", "-d", "storage", str(storage), cwd=one)
    sh(["git", "remote", "add", "origin", str(origin)], cwd=one)
    commit(one, "the project, a DVC remote")

    # Machine 1: the user's folder as versioned data, a run, a baseline, all committed and pushed.
    make(one, "add-data", f"SRC={make_imagefolder(tmp_path / 'pets', classes=3, per_class=14)}", "NAME=pets")
    commit(one, "data: pets")
    dvc("repro", cwd=one)
    make(one, "promote")
    make(one, "commit-run", "MSG=run 1")
    assert sh(["git", "status", "--porcelain"], cwd=one).stdout == ""  # nothing left to decide about
    first = {"shards": md5s(one / "data" / "shards"), "model": md5s(one / "models")}
    first_preprocess = lock_outs(one, "preprocess")
    sh(["git", "push", "-q", "origin", "HEAD:main"], cwd=one)
    dvc("push", cwd=one)

    # One training image swapped for another training image: a new data version, a new preprocess hash
    # (the test split and so the baseline's test set stay as they are), committed as run 2.
    params = load_params(one / "params.yaml")
    manifest = json.loads((one / "data" / "shards" / "manifest.json").read_text())
    swapped = one / "data" / "raw" / "pets" / next(f["path"] for f in manifest["files"] if f["split"] == "train")
    pre = params.preprocess
    for red in range(256):  # a replacement whose content hash also falls in the train split
        buffer = io.BytesIO()
        Image.new("RGB", (40, 40), (red, 10, 10)).save(buffer, format="PNG")
        if split_of(hashlib.sha256(buffer.getvalue()).hexdigest(), params.seed, pre.val_fraction,
                    pre.test_fraction) == "train":  # fmt: skip
            break
    swapped.write_bytes(buffer.getvalue())
    dvc("add", "data/raw/pets", cwd=one)
    dvc("repro", cwd=one)
    make(one, "commit-run", "MSG=run 2: one image swapped")
    assert lock_outs(one, "preprocess") != first_preprocess
    sh(["git", "push", "-q", "origin", "HEAD:main"], cwd=one)
    dvc("push", cwd=one)

    # Machine 2: its own clone and cache; only the git remote, the DVC remote and Prefect are shared.
    two = tmp_path / "machine2"
    sh(["git", "clone", "-q", str(origin), str(two)], cwd=tmp_path)
    assert not (two / ".dvc" / "cache").exists() and not (two / "models" / "model.pt").exists()  # git only
    dvc("pull", cwd=two)
    status = dvc("status", cwd=two).stdout  # (a) nothing to run
    assert stale_stages(two) == {}, status
    # Nothing was computed here: check-reproduced does not vouch for pulled outputs. make reproduce recomputes
    # every stage from the inputs (pets, the baseline) in a scratch worktree and compares with the record.
    pulled = subprocess.run(make_command("check-reproduced"), cwd=two, env=env_with_venv(), capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert pulled.returncode != 0 and "identical" not in pulled.stdout, pulled.stdout
    assert "nothing reproduced: 5 stages' outputs came from the remote or the cache" in pulled.stdout
    recomputed = make(two, "reproduce")
    assert recomputed.returncode == 0, recomputed.stdout[-3000:] + recomputed.stderr[-3000:]
    assert "inputs: baseline/" in recomputed.stdout and "data/raw/pets" in recomputed.stdout, recomputed.stdout
    assert {"generate", "preprocess", "train", "evaluate", "export"} <= set(ran_stages(recomputed.stdout))
    assert "identical: dvc.lock reproduces HEAD" in recomputed.stdout, recomputed.stdout[-3000:]
    assert sh(["git", "status", "--porcelain"], cwd=two).stdout == ""

    recorded = yaml.safe_load((two / "baseline" / "model.json").read_text())["onnx_sha256"]
    image = next((two / "data" / "raw" / "pets" / "class_1").glob("*.png")).read_bytes()
    with served(two) as url:  # (b) `make serve` there: the promoted baseline, hash-verified before it loads
        ready = httpx.get(f"{url}/ready", timeout=10).json()
        assert ready["model"]["sha256"] == recorded and ready["model"]["source"] == "baseline"
        assert httpx.post(f"{url}/predict", files={"file": ("x.png", image)}, timeout=30).status_code == 200

    env = prefect_env(tmp_path / "prefect-home", free_port())  # (c) the nightly, by a worker in this clone
    env["PREFECT_API_URL"] = f"http://127.0.0.1:{env['PREFECT_SERVER_API_PORT']}/api"
    production = Production(two, env)
    try:
        for step in ("server", "pool", "deploy", "worker"):
            production.script(step)
        proc, run = production.run_and_watch("regression-flow/nightly")
        assert proc.returncode == 0 and run.state.is_completed(), proc.stdout[-3000:] + proc.stderr[-3000:]
        verdict = production.artifacts(run.id)[KEYS["nightly"]].data
        assert "Production model vs baseline: PASS" in verdict and f"sha256 `{recorded}` verified" in verdict
    finally:
        production.script("stop")

    sh(["git", "checkout", "-q", "HEAD~1"], cwd=two)  # (d) back in time: run 1's bytes
    dvc("pull", cwd=two)
    assert md5s(two / "data" / "shards") == first["shards"]
    assert md5s(two / "models") == first["model"]
    assert lock_outs(two, "preprocess") == first_preprocess
    repro = dvc("repro", cwd=two).stdout
    assert ran_stages(repro) == ["environment", "check_regression"], repro
    assert stale_stages(two) == {}


def test_a_fresh_clone_reproduces_the_committed_run(tmp_path: Path) -> None:
    """The repository ships dvc.lock and reports/ for the default data: a fresh clone of HEAD runs every
    stage (nothing is cached there). On the CPU class the record was made on it writes the same record, so
    nothing is left to commit; on another (the environment records say which) the metrics stay within the
    tolerances and only the run's own outputs differ."""
    clone = tmp_path / "clone"
    sh(["git", "clone", "-q", str(ROOT), str(clone)], cwd=tmp_path)
    make(clone, "run")
    # git carries evaluate's outputs (cache: false); where the model comes out the same, `dvc repro` leaves them as
    # checked out, and make run's recompute step computes evaluate here: nothing is left unjudged.
    check = subprocess.run([sys.executable, "scripts/lock_diff.py", "HEAD"], cwd=clone, capture_output=True, text=True)
    assert "not recomputed here" not in check.stdout, check.stdout
    assert check.returncode == 0, check.stdout + check.stderr  # names each stage and file that differs
    changed = [line[3:] for line in sh(["git", "status", "--porcelain"], cwd=clone).stdout.splitlines()]
    if check.stdout.startswith("identical"):
        assert changed == []
    else:
        assert check.stdout.startswith("another environment than HEAD"), check.stdout
        assert "reproduced within tolerance in another environment" in check.stdout
        assert "reports/environment/train.json" in changed, changed  # the record names the other machine
        assert all(path == "dvc.lock" or path.startswith(("reports/", "models/")) for path in changed), changed
