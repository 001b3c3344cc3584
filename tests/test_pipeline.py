"""The whole DAG through real DVC in a real git repo, on tiny params: reproducible, incremental, gated."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasks.core.provenance import recomputed
from tasks.release import tracking
from tasks.training.precision import NATIVE_BF16_ENV, cpu_has_native_bf16
from tests.helpers.folders import make_imagefolder
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

PIPELINE_STAGES = tuple(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"])


def lock_md5s(repo: Path) -> dict[str, str]:
    """md5 of every output recorded in dvc.lock, by path."""
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    return {out["path"]: out["md5"] for stage in lock["stages"].values() for out in stage.get("outs", [])}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = make_project(tmp_path_factory.mktemp("pipeline") / "repo")
    dvc("repro", cwd=repo)
    return repo


def test_repro_produces_every_output(repo: Path) -> None:
    metrics = json.loads(dvc("metrics", "show", "--json", cwd=repo).stdout)
    accuracy = metrics[""]["data"]["reports/metrics.json"]["data"]["accuracy"]
    pairs = json.loads((repo / "reports/confusion.json").read_text())  # one {actual, predicted} row per test image
    assert accuracy == pytest.approx(sum(r["actual"] == r["predicted"] for r in pairs) / len(pairs), abs=1e-6)
    for path in ("models/model.pt", "models/model.onnx", "reports/confusion.png", "reports/train_curves.png"):
        assert (repo / path).stat().st_size > 0
    verdict = json.loads((repo / "reports/regression.json").read_text())
    assert verdict["passed"] and not verdict["has_baseline"]
    assert len(lock_md5s(repo)) >= 9


def test_second_repro_changes_nothing(repo: Path) -> None:
    before = (repo / "dvc.lock").read_text()
    proc = dvc("repro", cwd=repo)
    out = proc.stdout
    assert ran_stages(out) == ["environment", "check_regression"], out  # both always_changed; the scores reused
    assert "test scores of models/model.onnx reused from runs/check_regression/scores.json" in out + proc.stderr
    assert (repo / "dvc.lock").read_text() == before
    assert stale_stages(repo) == {}


def mlflow_runs(repo: Path) -> list[Any]:
    """The runs of the project's experiment table (mlflow.db beside it), newest first."""
    client = tracking.client(f"sqlite:///{repo / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("imagepipe")
    return client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"])


def set_tracking(repo: Path, enabled: bool) -> None:
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["tracking"]["enabled"] = enabled
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.mark.slow  # the default suite's budget (issue 59 item 4): make test-slow runs it
def test_every_run_that_reaches_the_gate_is_one_mlflow_run(repo: Path) -> None:
    """With tracking on (params.yaml as shipped), `dvc repro` logs one run; a no-op repro adds none;
    `dvc exp run -S regression.alpha=0.04` (in DVC's temporary copy; a gate's param, so only the gate reruns there)
    adds one, carrying 0.04, the commit it ran from and the data it read. With tracking off (the other tests'
    projects) a run logs nothing."""
    committed_record(repo)
    assert not (repo / "mlflow.db").exists()  # tracking.enabled false: the fixture's run logged nothing
    set_tracking(repo, enabled=True)
    try:
        committed_record(repo)  # only the gate declares tracking: it reruns, logs, and the record is committed
        before = mlflow_runs(repo)
        metrics = json.loads((repo / "reports/metrics.json").read_text())
        assert len(before) == 1 and before[0].data.metrics["test_accuracy"] == pytest.approx(metrics["accuracy"])
        assert before[0].data.params["train.lr"] == "0.01" and before[0].data.tags["source"] == "dvc repro"
        dvc("repro", cwd=repo)
        assert [r.info.run_id for r in mlflow_runs(repo)] == [r.info.run_id for r in before]
        experiment = dvc("exp", "run", "--temp", "-S", "regression.alpha=0.04", cwd=repo)
        after = mlflow_runs(repo)
        assert len(after) == len(before) + 1, experiment.stdout + experiment.stderr
        run = after[0]
        manifest = hashlib.sha256((repo / "data/shards/manifest.json").read_bytes()).hexdigest()
        head = sh(["git", "rev-parse", "HEAD"], cwd=repo).stdout.strip()
        assert run.data.params["regression.alpha"] == "0.04" and run.data.tags["source"] == "dvc exp run"
        assert run.data.tags["dvc.experiment"] and run.data.tags["git.commit"] == head
        assert run.data.tags["data.manifest_sha256"] == manifest and "test_accuracy" in run.data.metrics
        assert yaml.safe_load((repo / "params.yaml").read_text())["regression"]["alpha"] == 0.05  # --temp: untouched
        assert json.loads((repo / "reports/metrics.json").read_text()) == metrics
    finally:
        set_tracking(repo, enabled=False)
        committed_record(repo)


@pytest.mark.slow  # 48 s; identical weights from the same params: tests/stages/test_train.py
def test_from_scratch_twice_gives_identical_outputs(repo: Path, tmp_path: Path) -> None:
    other = make_project(tmp_path / "again")
    dvc("repro", cwd=other)
    assert lock_md5s(other) == lock_md5s(repo)


def test_worse_than_baseline_fails_the_pipeline(repo: Path) -> None:
    baseline = repo / "baseline" / "metrics.json"
    baseline.write_text(json.dumps({"accuracy": 1.0, "macro_f1": 1.0}))
    try:
        proc = dvc("repro", cwd=repo, check=False)
        assert proc.returncode != 0
        assert "REGRESSION: accuracy, macro_f1" in proc.stderr + proc.stdout
        verdict = json.loads((repo / "reports/regression.json").read_text())
        assert not verdict["passed"] and verdict["rules"][0]["baseline"] == 1.0
    finally:
        baseline.unlink()
    dvc("repro", cwd=repo)


@pytest.mark.slow  # 46 s; own folders of every layout: tests/test_own_data.py (slow), tests/stages/test_layout.py
def test_users_own_folder_with_other_classes(repo: Path, tmp_path: Path) -> None:
    source = make_imagefolder(tmp_path / "my images", classes=4, per_class=15)
    sh(["git", "add", "-A"], cwd=repo)
    sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "tiny run"], cwd=repo)
    dvc("exp", "run", "-S", f"data.source={source}", cwd=repo)
    metrics = json.loads((repo / "reports/metrics.json").read_text())
    assert sorted(metrics["per_class"]) == ["class_0", "class_1", "class_2", "class_3"]
    assert sorted(p.name for p in (repo / "data/generated").iterdir()) == ["SKIPPED.txt"]


def check_reproduced(repo: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "scripts/lock_diff.py"), "HEAD"], cwd=repo,
                          capture_output=True, text=True)  # fmt: skip


def committed_record(repo: Path) -> None:
    dvc("repro", cwd=repo)  # a production run's record (an earlier test left an experiment's, not enforced)
    commit(repo, "the run record", allow_empty=True)


def test_check_reproduced_tells_identical_from_a_bug(repo: Path) -> None:
    committed_record(repo)
    same = check_reproduced(repo)
    assert same.returncode == 0 and same.stdout.startswith("identical"), same.stdout
    lock = (repo / "dvc.lock").read_text()
    model_md5 = yaml.safe_load(lock)["stages"]["train"]["outs"][0]["md5"]
    # The committed run had other bytes from the same environment and inputs: a bug, named by stage and file.
    # (This workspace holds its own run, as its dvc.lock says; the record at HEAD is the one that differs.)
    (repo / "dvc.lock").write_text(lock.replace(model_md5, "0" * 32))
    commit(repo, "a record with other model bytes")
    (repo / "dvc.lock").write_text(lock)
    bug = check_reproduced(repo)
    assert bug.returncode == 1, bug.stdout
    assert "NOT REPRODUCED with the same inputs and the same environment" in bug.stdout
    assert "  train: models/model.pt" in bug.stdout
    commit(repo, "the run record again")


@pytest.mark.slow  # 90 s: two trainings in the other precision; the message on its own: tests/test_lock_diff.py
def test_check_reproduced_names_another_environment(repo: Path, tmp_path: Path) -> None:
    committed_record(repo)
    # The same checkout told its CPU is the other kind (native bf16 or not): precision auto resolves the other
    # way, and exactly the stages that depend on train's record rerun.
    here = "bf16" if cpu_has_native_bf16() else "fp32"
    there, told = ("fp32", "0") if here == "bf16" else ("bf16", "1")
    forced = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=repo, capture_output=True, text=True,
                            env={**env_with_venv(), NATIVE_BF16_ENV: told})  # fmt: skip
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert set(ran_stages(forced.stdout)) == {"environment", "train", "evaluate", "export", "check_regression"}
    dvc("repro", cwd=repo)  # this CPU's precision again: the committed bytes, by rerun or from the run cache
    again = check_reproduced(repo)
    assert again.returncode == 0 and again.stdout.startswith("identical"), again.stdout

    # A clone whose CPU says it is the other kind: precision auto resolves the other way, so train reruns there
    # (its environment record is a dep) and check-reproduced names why the bytes differ. The clone shares the
    # repo's DVC cache, as `dvc pull` would fill it; it recomputes every stage (run cache off), since
    # check-reproduced judges only what the workspace computed.
    clone = tmp_path / "clone"
    sh(["git", "clone", "-q", str(repo), str(clone)], cwd=tmp_path)
    dvc("cache", "dir", "--local", str(repo / ".dvc" / "cache"), cwd=clone)
    proc = subprocess.run([sys.executable, "-m", "dvc", "repro", "--force", "--no-run-cache"], cwd=clone,
                          capture_output=True, text=True, env={**env_with_venv(), NATIVE_BF16_ENV: told})  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((clone / "reports/environment/train.json").read_text())["precision"] == there
    assert json.loads((clone / "reports/train_run.json").read_text())["precision"] == there
    other = check_reproduced(clone)
    assert other.stdout.startswith("another environment than HEAD"), other.stdout
    assert f"train: precision {there} here, {here} in the committed run" in other.stdout
    assert "models/model.pt" in other.stdout and "evaluate" not in other.stdout.split("outputs that differ")[0]
    deltas = [line for line in other.stdout.splitlines() if line.strip().startswith(("accuracy:", "macro_f1:"))]
    assert len(deltas) == 2 and all("committed (delta" in line for line in deltas), other.stdout
    judged = [line for line in other.stdout.splitlines() if "committed (delta" in line]  # export.json's too
    within = all(line.endswith("within") for line in judged)
    assert other.returncode == (0 if within else 1), other.stdout


def test_check_reproduced_refuses_a_workspace_that_does_not_hold_the_run(repo: Path, tmp_path: Path) -> None:
    """A fresh clone with nothing run, and a stage whose output is gone (failed or interrupted): two dvc.lock
    files say nothing about outputs that are not there, so it names what is missing and exits 1."""
    committed_record(repo)
    clone = tmp_path / "clone"
    sh(["git", "clone", "-q", str(repo), str(clone)], cwd=tmp_path)
    fresh = check_reproduced(clone)
    assert fresh.returncode == 1 and fresh.stdout.startswith("not comparable"), fresh.stdout
    assert "  train: changed outs: models/model.pt (" in fresh.stdout and "identical" not in fresh.stdout
    model = repo / "models" / "model.pt"
    saved = model.read_bytes()
    model.unlink()  # what DVC leaves of a train stage that failed: its outputs removed before the command ran
    try:
        interrupted = check_reproduced(repo)
        assert interrupted.returncode == 1, interrupted.stdout
        assert "  train: changed outs: models/model.pt (deleted)" in interrupted.stdout
    finally:
        model.write_bytes(saved)
    assert check_reproduced(repo).stdout.startswith("identical")


@pytest.mark.slow  # the default suite's budget (issue 59 item 4): make test-slow runs it
def test_the_ledger_holds_what_dvc_recorded_and_a_pulled_clone_reproduced_nothing(repo: Path, tmp_path: Path) -> None:
    """Each stage run here left a ledger line with the hashes dvc.lock has. A clone whose outputs came from the
    cache, as `dvc pull` brings them, computed nothing: check-reproduced says so and exits 1, never "identical";
    a stage recomputed there is judged and the others are named."""
    committed_record(repo)
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    assert all(recomputed(repo, lock).values()), (repo / "runs" / "ledger.jsonl").read_text()[-2000:]
    clone = tmp_path / "clone"
    sh(["git", "clone", "-q", str(repo), str(clone)], cwd=tmp_path)
    dvc("cache", "dir", "--local", str(repo / ".dvc" / "cache"), cwd=clone)
    dvc("checkout", cwd=clone)
    pulled = check_reproduced(clone)
    assert pulled.returncode == 1 and "identical" not in pulled.stdout, pulled.stdout
    assert pulled.stdout.startswith("nothing reproduced: 5 stages' outputs came from the remote or the cache"), (
        pulled.stdout
    )
    assert "run `make reproduce`" in pulled.stdout and len(pulled.stdout.splitlines()) == 1
    dvc("repro", "--force", "--no-run-cache", "--single-item", "evaluate", cwd=clone)
    partly = check_reproduced(clone)
    assert partly.returncode == 1, partly.stdout
    assert "not recomputed here: train (its outputs came from" in partly.stdout
    assert "not recomputed here: evaluate" not in partly.stdout and "partly reproduced: 4 of 5" in partly.stdout
    # make run's second step computes here what no run here wrote, so the same check then says "identical".
    recompute = subprocess.run([sys.executable, "-m", "tasks.tools.recompute"], cwd=clone, env=env_with_venv(),
                               capture_output=True, text=True)  # fmt: skip
    assert recompute.returncode == 0, recompute.stdout + recompute.stderr
    assert recompute.stdout.count("computing it here") == 4, recompute.stdout  # evaluate was already
    assert check_reproduced(clone).stdout.startswith("identical")


@pytest.mark.slow  # 51 s; on a second machine from the remotes: tests/test_reproduce_anywhere.py (slow)
def test_make_reproduce_recomputes_every_stage_in_a_scratch_worktree(repo: Path) -> None:
    """The committed run, recomputed from its inputs with the run cache off, in a worktree that is gone after;
    this workspace's files, git status and worktrees are as they were."""
    committed_record(repo)
    before = {
        p: p.read_bytes() for p in (repo / "dvc.lock", repo / "models" / "model.pt", repo / "runs" / "ledger.jsonl")
    }
    status = sh(["git", "status", "--porcelain"], cwd=repo).stdout
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/reproduce.py"), "HEAD"], cwd=repo, capture_output=True,
                          text=True, env=env_with_venv())  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "every stage now runs from them: dvc repro --force --no-run-cache" in proc.stdout
    assert set(ran_stages(proc.stdout)) == set(PIPELINE_STAGES), ran_stages(proc.stdout)
    assert "identical: dvc.lock reproduces HEAD" in proc.stdout and "reproduce: took " in proc.stdout
    assert {p: p.read_bytes() for p in before} == before
    assert sh(["git", "status", "--porcelain"], cwd=repo).stdout == status
    assert len(sh(["git", "worktree", "list"], cwd=repo).stdout.splitlines()) == 1


def test_make_reproduce_interrupted_removes_its_worktree(repo: Path) -> None:
    committed_record(repo)
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts/reproduce.py"), "HEAD"], cwd=repo, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env_with_venv(),
                            start_new_session=True)  # fmt: skip
    assert proc.stdout is not None
    first = proc.stdout.readline()
    scratch = Path(first.rsplit(", ", 1)[-1].strip())
    while "Running stage '" not in (line := proc.stdout.readline()):  # dvc's own line: a stage has started
        assert line, "reproduce ended before running a stage"
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group, while dvc runs its first stages
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-2000:] + err[-2000:]
    assert "interrupted; the scratch worktree is removed and nothing in this workspace changed" in err
    assert not scratch.exists(), scratch
    assert len(sh(["git", "worktree", "list"], cwd=repo).stdout.splitlines()) == 1
    assert stale_stages(repo) == {}


def head(repo: Path) -> str:
    return sh(["git", "rev-parse", "HEAD"], cwd=repo).stdout.strip()


@pytest.mark.slow  # the default suite's budget (issue 59 item 4): make test-slow runs it
def test_commit_run_refuses_a_partial_run(repo: Path) -> None:
    """An export param changed and only `dvc repro export` run: the verdict is the old export's, so the run is not
    committed, and git is left as it was. (An export param, not train's: a train with `cache: false` outputs is
    never restored from DVC's run cache, so changing it back would train again.)"""
    committed_record(repo)
    params = (repo / "params.yaml").read_text()
    before = head(repo)
    try:
        changed = yaml.safe_load(params)
        changed["export"]["timing"]["repeats"] += 1
        (repo / "params.yaml").write_text(yaml.safe_dump(changed, sort_keys=False))
        dvc("repro", "export", cwd=repo)
        assert json.loads((repo / "reports/gate.json").read_text())["verdict"] == "no baseline"  # stale, still there
        proc = subprocess.run(make_command("commit-run"), cwd=repo, capture_output=True, text=True,
                              env=env_with_venv())  # fmt: skip
        assert proc.returncode != 0, proc.stdout + proc.stderr
        assert "[commit-run] refused: stage " in proc.stderr and "is not up to date by `dvc status`" in proc.stderr
        assert "check_regression" in proc.stderr and "Run `dvc repro` (make run) first" in proc.stderr
        assert head(repo) == before
    finally:
        (repo / "params.yaml").write_text(params)
    dvc("repro", cwd=repo)


def test_promote_refuses_a_verdict_computed_against_another_baseline(repo: Path) -> None:
    """Scored with no baseline, then a teammate's baseline arrives: promote compares nothing, so it refuses
    and leaves baseline/ byte for byte as it was."""
    committed_record(repo)
    assert json.loads((repo / "reports/regression.json").read_text())["baseline_sha256"] is None
    theirs = {"metrics.json": json.dumps({"accuracy": 0.99, "macro_f1": 0.99}).encode(),
              "model.json": json.dumps({"onnx_sha256": "f" * 64}).encode(), "model.onnx": b"their model"}  # fmt: skip
    for name, data in theirs.items():
        (repo / "baseline" / name).write_bytes(data)
    try:
        proc = subprocess.run(make_command("promote"), cwd=repo, capture_output=True, text=True, env=env_with_venv())
        assert proc.returncode != 0, proc.stdout + proc.stderr
        assert "refused: stage check_regression is not up to date by `dvc status`" in proc.stderr, proc.stderr
        assert "changed deps: baseline (modified)" in proc.stderr
        assert {name: (repo / "baseline" / name).read_bytes() for name in theirs} == theirs
        assert not list((repo / "baseline").glob("*.dvc"))
    finally:
        for name in theirs:
            (repo / "baseline" / name).unlink()


def test_the_single_item_gate_after_an_experiment_enforces_the_verdict(repo: Path) -> None:
    """`dvc exp run` records a regression without enforcing it; `dvc repro -s check_regression` afterwards
    (which does not run the environment stage) enforces it, as `dvc repro` does."""
    committed_record(repo)
    baseline = repo / "baseline" / "metrics.json"
    baseline.write_text(json.dumps({"accuracy": 1.0, "macro_f1": 1.0}))
    try:
        experiment = dvc("exp", "run", cwd=repo)
        assert "REGRESSION" in experiment.stdout + experiment.stderr
        gate = json.loads((repo / "reports/gate.json").read_text())
        assert gate["verdict"] == "regression" and gate["enforced"] is False
        single = dvc("repro", "-s", "check_regression", cwd=repo, check=False)
        assert single.returncode != 0, single.stdout + single.stderr
        assert "[check_regression] REGRESSION: accuracy, macro_f1" in single.stderr
        assert json.loads((repo / "reports/gate.json").read_text())["enforced"] is True
    finally:
        baseline.unlink()
    dvc("repro", cwd=repo)
