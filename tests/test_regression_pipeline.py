"""The regression gate through real DVC: promote, make the model worse with a param, fail, restore, pass.

A tiny ImageFolder of colour-coded classes (the model learns it in two short epochs), a copy of the
project as a git + DVC repository, and `make promote`'s command.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.folders import make_imagefolder
from tests.helpers.project import (
    TINY,
    commit,
    deep_update,
    dvc,
    env_with_venv,
    make_command,
    make_project,
    sh,
    stale_stages,
    write_params,
)

# Three full runs of the tiny pipeline (about 1-3 minutes on 2 cores): make test-slow. The default
# suite covers the same gate without DVC in tests/stages/test_check_regression.py.
pytestmark = pytest.mark.slow


def read(repo: Path, name: str) -> Any:
    return json.loads((repo / "reports" / name).read_text())


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("gate-pipeline")
    source = make_imagefolder(root / "images", classes=3, per_class=30)
    good = {"data": {"source": str(source)}, "train": {"epochs": 4}}
    repo = make_project(root / "repo", good)
    dvc("repro", cwd=repo)
    return repo, good


def test_a_worse_model_fails_at_check_regression_until_the_param_is_restored(repo: tuple[Path, dict]) -> None:
    repo_dir, good = repo
    assert not read(repo_dir, "regression.json")["has_baseline"]
    promoted = sh([sys.executable, "-m", "tasks.tools.promote"], cwd=repo_dir)
    assert "tracked by DVC" in promoted.stdout
    for name in ("metrics.json", "model.json", "model.onnx"):
        assert (repo_dir / "baseline" / f"{name}.dvc").is_file()
    baseline_accuracy = json.loads((repo_dir / "baseline/metrics.json").read_text())["accuracy"]
    assert baseline_accuracy > 0.9

    dvc("repro", cwd=repo_dir)  # the baseline is a dependency: check_regression reruns and passes
    assert read(repo_dir, "regression.json")["passed"] and read(repo_dir, "regression.json")["has_baseline"]

    write_params(repo_dir, deep_update(TINY, deep_update(good, {"train": {"lr": 1e-5}})))
    proc = dvc("repro", cwd=repo_dir, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "failed to reproduce 'check_regression'" in log
    assert "REGRESSION: accuracy, macro_f1" in log
    assert f"accuracy: {read(repo_dir, 'regression.json')['metrics']['accuracy']:.4f} vs baseline " in log
    assert f"vs baseline {baseline_accuracy:.4f} (delta -" in log
    accuracy = read(repo_dir, "regression.json")["rules"][0]
    assert accuracy["metric"] == "accuracy" and not accuracy["passed"]
    assert accuracy["baseline"] == baseline_accuracy and accuracy["delta"] < -0.2

    write_params(repo_dir, deep_update(TINY, good))
    dvc("repro", cwd=repo_dir)
    assert read(repo_dir, "regression.json")["passed"]
    assert stale_stages(repo_dir) == {}


def test_an_experiment_on_other_data_keeps_its_metrics_and_its_verdict(repo: tuple[Path, dict]) -> None:
    """After a promote on one dataset, `dvc exp run -S data.source=<another folder>` is kept: its gate
    verdict is a `different test set` column of `dvc exp show`, not a failed stage. A failed experiment
    is recovered with `git checkout params.yaml && dvc repro` (the run cache restores the outputs)."""
    repo_dir, good = repo
    if not (repo_dir / "baseline/metrics.json").is_file():
        sh([sys.executable, "-m", "tasks.tools.promote"], cwd=repo_dir)
    other = make_imagefolder(repo_dir.parent / "other-images", classes=4, per_class=25, seed=5)
    commit(repo_dir, "promoted")
    proc = dvc("exp", "run", "-n", "other-data", "-S", f"data.source={other}", cwd=repo_dir, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "different test set: the baseline was scored on" in log and "not enforced" in log
    shown = dvc("exp", "show", "--csv", cwd=repo_dir).stdout
    header, *rows = list(csv.reader(io.StringIO(shown)))  # the verdict's summary holds commas
    verdict = next(i for i, name in enumerate(header) if name.endswith("verdict"))
    by_name = {row[header.index("Experiment")]: row for row in rows}
    assert by_name["other-data"][verdict] == "different test set"
    assert by_name["other-data"][header.index("accuracy")] not in ("", "-")  # its metrics were kept
    committed = [
        row for row in rows if row[header.index("Experiment")] == "" and row[header.index("rev")] != "workspace"
    ]
    assert [row[verdict] for row in committed] == ["pass"]  # the commit the experiment started from

    # A failed experiment: the value stays in params.yaml and train's outputs are gone; then recovered.
    failed = dvc("exp", "run", "-S", "train.epochs=0", cwd=repo_dir, check=False)
    assert failed.returncode != 0 and "train.epochs: Input should be greater than or equal to 1" in failed.stderr
    assert "epochs: 0" in (repo_dir / "params.yaml").read_text()
    sh(["git", "checkout", "params.yaml"], cwd=repo_dir)
    dvc("repro", cwd=repo_dir)
    assert stale_stages(repo_dir) == {}
    assert read(repo_dir, "gate.json")["verdict"] == "pass"


def test_a_changed_byte_in_the_onnx_file_is_caught_before_use(repo: tuple[Path, dict]) -> None:
    repo_dir, _ = repo
    path = repo_dir / "models/model.onnx"
    original = path.read_bytes()
    data = bytearray(original)
    data[len(data) // 3] ^= 0x01
    path.write_bytes(bytes(data))
    try:
        proc = dvc("repro", "--single-item", "check_regression", cwd=repo_dir, check=False)
        assert proc.returncode != 0
        assert "models/model.onnx: sha256" in proc.stderr and "does not match the recorded" in proc.stderr
        promoted = sh([sys.executable, "-m", "tasks.tools.promote"], cwd=repo_dir, check=False)
        assert promoted.returncode == 2 and "does not match the recorded" in promoted.stderr
    finally:
        path.write_bytes(original)


def test_a_regression_an_experiment_recorded_fails_every_production_run(
    repo: tuple[Path, dict], prefect_api: None
) -> None:
    """`dvc exp run` records a regression without enforcing it. The production runs after it, whose
    stages DVC would otherwise skip, fail on it: make run, train-flow/prod; commit-run and promote refuse."""
    from flows.train_flow import train_flow

    repo_dir, good = repo
    if not (repo_dir / "baseline/metrics.json").is_file():
        sh([sys.executable, "-m", "tasks.tools.promote"], cwd=repo_dir)
    commit(repo_dir, "promoted a good model")
    experiment = dvc("exp", "run", "-S", "train.lr=0.00001", cwd=repo_dir, check=False)
    assert experiment.returncode == 0, (experiment.stdout + experiment.stderr)[-3000:]
    assert read(repo_dir, "gate.json")["verdict"] == "regression" and read(repo_dir, "gate.json")["enforced"] is False
    try:
        run = subprocess.run(make_command("run"), cwd=repo_dir, capture_output=True, text=True, env=env_with_venv())
        assert run.returncode != 0, run.stdout[-2000:]
        named = [line for line in run.stderr.splitlines() if "REGRESSION" in line]
        assert len(named) == 1 and named[0].startswith("[check_regression] REGRESSION: accuracy"), run.stderr
        assert "Pipeline finished" not in run.stdout
        assert read(repo_dir, "gate.json")["enforced"] is True

        # The failed gate left check_regression out of date by DVC's status (its verdict is not in dvc.lock):
        # neither the record nor the baseline moves, and both name the one recorded way past it.
        refused = subprocess.run(make_command("commit-run"), cwd=repo_dir, capture_output=True, text=True,
                                 env=env_with_venv())  # fmt: skip
        assert refused.returncode != 0
        assert "[commit-run] refused: the gate failed on this run (REGRESSION: accuracy" in refused.stderr
        assert 'make it the baseline anyway, saying why: `make promote ACCEPT="<why>"`' in refused.stderr
        assert sh(["git", "log", "-1", "--format=%s"], cwd=repo_dir).stdout.strip() == "promoted a good model"

        baseline = {p.name: p.read_bytes() for p in (repo_dir / "baseline").iterdir() if p.is_file()}
        promoted = subprocess.run(make_command("promote"), cwd=repo_dir, capture_output=True, text=True,
                                  env=env_with_venv())  # fmt: skip
        assert promoted.returncode != 0 and "refused: the gate failed on this run" in promoted.stderr
        assert {p.name: p.read_bytes() for p in (repo_dir / "baseline").iterdir() if p.is_file()} == baseline

        with contextlib.chdir(repo_dir):
            state = train_flow(push=False, return_state=True)
        assert state.is_failed()
        with pytest.raises(Exception, match=r"stage 'check_regression' failed[\s\S]*REGRESSION"):
            state.result()
    finally:
        sh(["git", "checkout", "params.yaml"], cwd=repo_dir)
        dvc("repro", cwd=repo_dir)
    assert read(repo_dir, "gate.json") | {"summary": ""} == {"verdict": "pass", "passed": True, "enforced": True,
                                                               "summary": ""}  # fmt: skip
