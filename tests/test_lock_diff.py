"""scripts/lock_diff.py (make check-reproduced) tells apart: identical, the same environment with other bytes
(a bug, named by stage and file), another environment (named, with metric deltas), and changed inputs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from tasks.core.provenance import lock_digest
from tests.helpers.project import ROOT, commit, make_project

sys.path.insert(0, str(ROOT / "scripts"))
import lock_diff  # noqa: E402

ENV = "reports/environment/train.json"


def entry(path: str, md5: str) -> dict[str, str]:
    return {"path": path, "hash": "md5", "md5": md5}  # as DVC 3 writes it: `hash` names the algorithm


def stage(deps: dict[str, str], outs: dict[str, str], cmd: str = "python -m tasks.x", **params: object) -> dict:
    return {
        "cmd": cmd,
        "deps": [entry(p, m) for p, m in deps.items()],
        "params": {"params.yaml": params},
        "outs": [entry(p, m) for p, m in outs.items()],
    }


def lock(train_env: str = "e1", model: str = "x", metrics: str = "m", lr: float = 0.1) -> dict:
    return {
        "environment": stage({"tasks/environment.py": "c"}, {ENV: train_env}),
        "train": stage({ENV: train_env, "shards": "a", "tasks/train.py": "t"}, {"model.pt": model}, train={"lr": lr}),
        "evaluate": stage({"model.pt": model}, {"metrics.json": metrics}),
    }


def test_the_digest_is_the_md5_not_the_name_of_the_algorithm() -> None:
    assert lock_digest({"path": "a", "hash": "md5", "md5": "abc"}) == "abc"
    assert lock_digest({"path": "a", "md5": "abc"}) == "abc"  # DVC 2's lock
    old, new = lock(), lock(model="y")
    assert lock_diff.classify(old, new)["train"]["outs"] == ["model.pt"]  # not equal because both say "md5"


def test_a_changed_command_is_a_changed_input() -> None:
    old, new = lock(), lock()
    new["train"]["cmd"] = "python -m tasks.train --something"
    assert "train: cmd changed" in lock_diff.differences(old, new)
    lines, status = lock_diff.verdict("HEAD", old, new)
    assert status == 1 and lines[0].startswith("not a reproduction: inputs differ")


def test_the_same_inputs_and_environment_with_other_bytes_is_a_bug_named_by_stage_and_file() -> None:
    lines, status = lock_diff.verdict("HEAD", lock(), lock(model="y", metrics="n"))
    assert status == 1
    assert lines == [
        "NOT REPRODUCED with the same inputs and the same environment as HEAD: a reproducibility bug in",
        "  train: model.pt",  # evaluate's metrics follow from the model, so only train is the bug
    ]
    assert lock_diff.verdict("HEAD", lock(), lock()) == (
        ["identical: dvc.lock reproduces HEAD: every stage's command, deps, params and outputs"], 0)  # fmt: skip


def test_changed_params_and_code_are_named() -> None:
    changed = lock(lr=0.2, model="y")
    assert "train: params train changed" in lock_diff.differences(lock(), changed)
    assert "evaluate: dep model.pt changed (an upstream output)" in lock_diff.differences(lock(), changed)
    assert "train: model.pt md5 x -> y" in lock_diff.differences(lock(), changed)


def test_another_environment_is_named_with_the_metric_deltas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real git repository: the committed run's records, and this checkout's (the dvc.lock files are
    written by hand, so the comparison is called past the workspace check, which the pipeline tests cover)."""
    repo = make_project(tmp_path / "repo")
    record = {"stage": "train", "precision": "fp32", "threads": 2, "libraries": {"torch": "2.14.1"}}
    (repo / "reports/environment").mkdir(parents=True, exist_ok=True)
    (repo / ENV).write_text(json.dumps(record))
    (repo / "reports/metrics.json").write_text(json.dumps({"accuracy": 0.95, "macro_f1": 0.94}))
    (repo / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": lock()}))
    commit(repo, "the committed run")
    monkeypatch.chdir(repo)

    class Run:
        def __init__(self) -> None:
            lines, self.returncode = lock_diff.compare("HEAD")
            self.stdout = "\n".join(lines) + "\n"

    for path, content in (("reports/export.json", {"agreement": 1.0}), ("reports/gate.json", {"verdict": "pass"})):
        (repo / path).write_text(json.dumps(content))
    commit(repo, "the committed run's other metric files")
    assert Run().returncode == 0

    (repo / ENV).write_text(json.dumps({**record, "precision": "bf16", "libraries": {"torch": "2.15.0"}}))
    (repo / "reports/metrics.json").write_text(json.dumps({"accuracy": 0.948, "macro_f1": 0.945}))
    (repo / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": lock("e2", "y", "n")}))
    near = Run()
    assert near.returncode == 0, near.stdout
    assert "  train: precision bf16 here, fp32 in the committed run" in near.stdout
    assert "  train: libraries.torch 2.15.0 here, 2.14.1 in the committed run" in near.stdout
    assert "threads" not in near.stdout  # only what differs
    assert "accuracy: 0.9480 here, 0.9500 committed (delta -0.0020, tolerance 0.01): within" in near.stdout
    assert near.stdout.strip().endswith("reproduced within tolerance in another environment")

    (repo / "reports/metrics.json").write_text(json.dumps({"accuracy": 0.90, "macro_f1": 0.945}))
    far = Run()
    assert far.returncode == 1
    assert "accuracy: 0.9000 here, 0.9500 committed (delta -0.0500, tolerance 0.01): OUTSIDE" in far.stdout
    assert "NOT REPRODUCED: another environment moved the metrics beyond the tolerance" in far.stdout

    # Every metric file is judged: the ONNX agreement, and the regression verdict, not accuracy alone.
    (repo / "reports/metrics.json").write_text(json.dumps({"accuracy": 0.948, "macro_f1": 0.945}))
    (repo / "reports/export.json").write_text(json.dumps({"agreement": 0.97}))
    onnx = Run()
    assert onnx.returncode == 1 and "export.json agreement: 0.9700 here, 1.0000 committed" in onnx.stdout
    (repo / "reports/export.json").write_text(json.dumps({"agreement": 1.0}))
    (repo / "reports/gate.json").write_text(json.dumps({"verdict": "regression"}))
    gate = Run()
    assert gate.returncode == 1 and "gate.json verdict: 'regression' here, 'pass' committed: OTHER" in gate.stdout

    # The environment differs, yet a stage with the same record wrote other bytes: still a bug.
    bug = lock("e2", "y", "n")
    bug["evaluate"]["deps"] = [entry("model.pt", "x")]  # evaluate's own inputs are the committed ones
    bug["evaluate"]["outs"] = [entry("metrics.json", "other")]
    lines, status = lock_diff.verdict("HEAD", lock(), bug)
    assert status == 1 and lines[1:] == ["  evaluate: metrics.json"]
