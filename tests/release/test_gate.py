"""What make commit-run and make promote refuse (tasks/release/gate.py, tasks/tools/record.py), and the recorded
decision they name (make promote ACCEPT="<why>")."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks.core.io import sha256_file, write_json
from tasks.core.paths import Paths
from tasks.release.gate import commit_refusal, failed_export_gates, hooks_refusal, promote_refusal
from tasks.release.production import baseline_sha256
from tasks.tools.record import record_refusal
from tests.helpers.project import ROOT

pytestmark = pytest.mark.fast  # unit-level: make test-fast

GATE = Path("reports/gate.json")


def gate(verdict: str, enforced: bool = True) -> dict[str, object]:
    return {"verdict": verdict, "passed": verdict == "pass", "enforced": enforced, "summary": f"the {verdict} line"}


def test_commit_run_takes_a_passing_enforced_record_only() -> None:
    assert commit_refusal(gate("pass"), GATE, {"test_hooks": None}) is None
    assert commit_refusal(gate("no baseline"), GATE, {}) is None
    for verdict in ("regression", "different test set"):  # the way past either is a recorded promotion
        refusal = commit_refusal(gate(verdict), GATE, {})
        assert refusal == (f"reports/gate.json records verdict '{verdict}' (the {verdict} line); fix the model, or "
                           'ship it anyway as the new baseline, recorded: `make promote ACCEPT="<why>"`, then make '
                           "commit-run")  # fmt: skip
    experiment = commit_refusal(gate("pass", enforced=False), GATE, {})
    assert (
        experiment is not None and "recorded by `dvc exp run`, which does not enforce it; run `make run`" in experiment
    )
    hooked = commit_refusal(gate("pass"), GATE, {"test_hooks": "/x/faults.py (sha256 ab)"})
    assert hooked is not None and "trained with test hooks (/x/faults.py (sha256 ab))" in hooked


def test_promote_takes_a_failed_or_incomparable_gate_only_with_a_reason() -> None:
    for verdict in ("regression", "different test set"):
        refusal = promote_refusal(gate(verdict), Path("reports/regression.json"), accepted=False)
        assert refusal is not None and 'say why: `make promote ACCEPT="<why>"`' in refusal, refusal
        assert f"records verdict '{verdict}'" in refusal
        assert promote_refusal(gate(verdict), Path("r"), accepted=True) is None
    assert promote_refusal(gate("no baseline"), Path("r"), accepted=False) is None
    assert promote_refusal(gate("pass"), Path("r"), accepted=False) is None
    assert hooks_refusal(None, "m") is None and "never the project's" in str(hooks_refusal("h", "models/model.onnx"))


def test_a_failed_export_gate_is_found_whatever_the_recorded_passed_says() -> None:
    ok = {"name": "onnx_int8.agreement", "op": ">=", "limit": 0.98, "value": 0.99, "passed": True, "param": "p"}
    assert failed_export_gates({"verdict": "different test set", "export_gates": [ok]}) == []
    lying = {**ok, "value": 0.5}  # recorded passed, but the value says otherwise
    failed = {**ok, "value": 0.5, "passed": False}
    for gate_record in (lying, failed):
        assert failed_export_gates({"export_gates": [ok, gate_record]}) == [
            "onnx_int8.agreement 0.5 (must be >= 0.98, p)"
        ]


def test_the_record_must_be_this_workspaces_onnx_and_baseline(tmp_path: Path) -> None:
    """A real (empty) DVC repository, so DVC's status has nothing stale: the verdict's own hashes decide."""
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=tmp_path, check=True)
    paths = Paths(onnx=tmp_path / "model.onnx", reports=tmp_path / "reports", baseline=tmp_path / "baseline")
    paths.onnx.write_bytes(b"this model")
    paths.reports.mkdir()
    record = {"model": {"onnx_sha256": sha256_file(paths.onnx)}, "baseline_sha256": None, "verdict": "no baseline",
              "export_gates": []}  # fmt: skip
    write_json(paths.regression_json, record)
    assert record_refusal(paths, tmp_path) is None

    paths.baseline.mkdir()
    (paths.baseline / "metrics.json").write_text('{"accuracy": 0.99}')  # a teammate's baseline, pulled since
    refusal = record_refusal(paths, tmp_path)
    assert refusal is not None and "compared against baseline sha256 none, but" in refusal
    assert refusal.endswith("run `dvc repro` (make run) so the gate compares this model with it")
    write_json(paths.regression_json, {**record, "baseline_sha256": baseline_sha256(paths.baseline)})
    assert record_refusal(paths, tmp_path) is None

    paths.onnx.write_bytes(b"another model")
    refusal = record_refusal(paths, tmp_path)
    assert refusal is not None and f"scored ONNX sha256 {record['model']['onnx_sha256'][:12]}, but" in refusal
    paths.onnx.write_bytes(b"this model")
    failed = {"name": "onnx_int8.accuracy_drop", "op": "<=", "limit": 0.01, "value": 0.2, "passed": False,
              "param": "int8.max_accuracy_drop"}  # fmt: skip
    write_json(paths.regression_json, {**record, "baseline_sha256": baseline_sha256(paths.baseline),
                                       "verdict": "different test set", "export_gates": [failed]})  # fmt: skip
    refusal = record_refusal(paths, tmp_path)
    assert refusal is not None and "export gate failed: onnx_int8.accuracy_drop 0.2" in refusal
    assert "(verdict 'different test set')" in refusal


def test_the_baseline_hash_covers_its_test_set_but_a_lone_test_set_is_no_baseline(tmp_path: Path) -> None:
    baseline = tmp_path / "baseline"
    baseline.mkdir()
    write_json(baseline / "test_set.json", {"images": {}})
    assert baseline_sha256(baseline) is None  # a stray test_set.json does not make a baseline
    write_json(baseline / "metrics.json", {"accuracy": 0.9})
    with_test_set = baseline_sha256(baseline)
    write_json(baseline / "test_set.json", {"images": {"a" * 64: "cat"}})
    assert with_test_set is not None and baseline_sha256(baseline) not in (None, with_test_set)
    (baseline / "test_set.json").unlink()
    assert baseline_sha256(baseline) not in (None, with_test_set)


def test_commit_run_refuses_code_the_commit_would_not_hold(tmp_path: Path) -> None:
    """A stage's code changed, run (dvc.lock names its new md5) but not staged: `git commit` would keep the old
    bytes beside a record of the new ones. Refused, naming the file, a `${}` dep as DVC resolves it included;
    staged, it is what the commit holds. Another stage's output is DVC's to keep, not git's."""
    from tasks.tools.commit_run import unstaged_deps, unstaged_refusal

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    (tmp_path / "tasks").mkdir()
    (tmp_path / "weights").mkdir()
    for name in ("tasks/evaluate.py", "tasks/train.py", "weights/notes.txt", "params.yaml"):
        (tmp_path / name).write_text("paths:\n  weights: weights/notes.txt\n" if name == "params.yaml" else "# x\n")
    dag = {"stages": {"evaluate": {"cmd": "python -m tasks.evaluate",
                                   "deps": ["tasks/evaluate.py", "tasks/new.py", "${paths.weights}", "out/x.json"]},
                      "train": {"cmd": "python -m tasks.train", "deps": ["tasks/train.py"],
                                "outs": ["out/x.json"]}}}  # fmt: skip
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(dag))
    git("init", "-q")
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=tmp_path, check=True)
    git("-c", "user.email=t@t", "-c", "user.name=t", "add", ".")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "start")
    assert unstaged_deps(tmp_path) == []
    (tmp_path / "tasks" / "evaluate.py").write_text("# a stage, changed\n")
    (tmp_path / "tasks" / "new.py").write_text("# imported by evaluate now\n")  # untracked
    (tmp_path / "weights" / "notes.txt").write_text("# changed\n")  # a `${}` dep
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x.json").write_text("{}")  # train's output: DVC's cache holds it
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(dag) + "# make commit-run adds it itself\n")
    assert unstaged_deps(tmp_path) == ["tasks/evaluate.py", "tasks/new.py", "weights/notes.txt"]
    refusal = unstaged_refusal(unstaged_deps(tmp_path))
    assert refusal is not None and refusal.startswith("tasks/evaluate.py tasks/new.py weights/notes.txt: changed")
    assert "`git add tasks/evaluate.py tasks/new.py weights/notes.txt` and make commit-run again" in refusal
    git("add", "tasks/evaluate.py", "tasks/new.py", "weights/notes.txt")
    assert unstaged_deps(tmp_path) == [] and unstaged_refusal([]) is None
    (tmp_path / "tasks" / "train.py").unlink()  # deleted and not staged: the commit would keep it
    assert unstaged_deps(tmp_path) == ["tasks/train.py"]


GATE_SCRIPT = """
import json, sys
from pathlib import Path
from tasks.core.io import sha256_file
from tasks.images.image_set import split_sha256
from tasks.images.shards import load_manifest
from tasks.release.production import baseline_sha256
from tasks.core.params import load_params
from tasks.core.provenance import md5_file
judged_by = {"regression": load_params().regression.model_dump(mode="json"), "code": {"tasks/gate.py": md5_file(
    Path("tasks/gate.py"))}}  # as check_regression records the rules and code that judged
verdict = {"judged_by": judged_by, "verdict": "regression", "passed": False, "export_gates": [],
           "summary": "REGRESSION: accuracy failed", "model": {"onnx_sha256": sha256_file(Path("model.onnx"))},
           "baseline_sha256": baseline_sha256(Path("baseline")),
           "metrics": {"test_set_sha256": split_sha256(load_manifest(Path("shards")))}}
Path("reports").mkdir(exist_ok=True)
Path("reports/regression.json").write_text(json.dumps(verdict))
sys.exit(1)
"""


def test_a_failed_gate_of_this_run_is_named_and_only_a_reason_lets_promote_past_it(tmp_path: Path) -> None:
    """A real `dvc repro` whose gate fails: DVC records no check_regression. The failed verdict of this very run
    names make promote ACCEPT; accepting passes it, but not when the verdict is another model's or another test
    set's, nor when a rule of params.yaml or the gate's code changed since (the gate must run again)."""
    from tasks.images.shards import FORMAT_VERSION

    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "gate.py").write_text(GATE_SCRIPT)
    (tmp_path / "model.onnx").write_bytes(b"this model")
    (tmp_path / "baseline").mkdir()
    (tmp_path / "baseline" / "metrics.json").write_text('{"accuracy": 0.99}')
    (tmp_path / "shards").mkdir()
    manifest = {"format_version": FORMAT_VERSION, "files": [{"split": "test", "sha256": "a" * 64}]}
    write_json(tmp_path / "shards" / "manifest.json", manifest)
    shutil.copyfile(ROOT / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "dvc.yaml").write_text(
        yaml.safe_dump(
            {
                "stages": {
                    "check_regression": {
                        "cmd": f"PYTHONPATH={ROOT} {sys.executable} tasks/gate.py",
                        "deps": ["model.onnx", "baseline", "shards", "tasks/gate.py"],
                        "params": ["regression"],
                        "outs": [{"reports/regression.json": {"cache": False}}],
                    }
                }
            }
        )
    )
    proc = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode != 0 and (tmp_path / "reports" / "regression.json").is_file(), proc.stderr
    paths = Paths(onnx=Path("model.onnx"), reports=Path("reports"), baseline=Path("baseline"), shards=Path("shards"))

    refusal = record_refusal(paths, tmp_path)
    assert refusal is not None and refusal.startswith("the gate failed on this run (REGRESSION: accuracy failed)")
    assert refusal.endswith('saying why: `make promote ACCEPT="<why>"`')
    assert record_refusal(paths, tmp_path, accepting=True) is None

    write_json(tmp_path / "shards" / "manifest.json", {**manifest, "files": [{"split": "test", "sha256": "b" * 64}]})
    other_set = record_refusal(paths, tmp_path, accepting=True)  # the shards changed since: not this run's verdict
    assert other_set is not None and "is not up to date by `dvc status`" in other_set
    write_json(tmp_path / "shards" / "manifest.json", manifest)
    (tmp_path / "model.onnx").write_bytes(b"another model")
    assert "is not up to date" in str(record_refusal(paths, tmp_path, accepting=True))
    (tmp_path / "model.onnx").write_bytes(b"this model")
    assert record_refusal(paths, tmp_path, accepting=True) is None

    params = (tmp_path / "params.yaml").read_text()
    assert "  alpha: 0.05" in params
    (tmp_path / "params.yaml").write_text(params.replace("  alpha: 0.05", "  alpha: 0.01"))  # a rule changed since
    ruled = record_refusal(paths, tmp_path, accepting=True)
    assert ruled is not None and "the gate failed, but params.yaml's regression section changed since" in ruled
    (tmp_path / "params.yaml").write_text(params)
    assert record_refusal(paths, tmp_path, accepting=True) is None
    (tmp_path / "tasks" / "gate.py").write_text(GATE_SCRIPT + "\n# edited\n")  # the gate's code changed since
    assert "tasks/gate.py" in str(record_refusal(paths, tmp_path, accepting=True))


def test_a_decision_names_who_when_and_what_it_set_aside_and_the_commit_keeps_it(tmp_path: Path) -> None:
    from tasks.tools.decision import commit_trailer, decision_record, registry_tags

    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "config", "user.name", "Ada Lovelace"], cwd=tmp_path, check=True)
    verdict = {"verdict": "regression", "summary": "REGRESSION: accuracy failed", "baseline_sha256": "b" * 64,
               "rules": [{"metric": "accuracy", "passed": False}, {"metric": "macro_f1", "passed": True}]}  # fmt: skip
    decision = decision_record(verdict, "a" * 64, "the drop is a relabelled class", tmp_path)
    assert decision["by"] == "Ada Lovelace" and decision["accepted"] is True and decision["gate"] == "regression"
    assert decision["set_aside"] == {"verdict": "regression", "summary": "REGRESSION: accuracy failed",
                                     "failed_rules": [{"metric": "accuracy", "passed": False}],
                                     "baseline_sha256": "b" * 64}  # fmt: skip
    assert registry_tags(decision)["decision.set_aside"] == "regression: REGRESSION: accuracy failed"
    passed = decision_record({"verdict": "pass"}, "a" * 64, None, tmp_path)
    assert passed["set_aside"] is None and passed["accepted"] is False
    assert "decision.reason" not in registry_tags(passed)

    baseline = tmp_path / "baseline"
    baseline.mkdir()
    write_json(baseline / "decision.json", decision)
    (baseline / "decision.json.dvc").write_text("outs:\n- md5: 1\n")
    assert commit_trailer(Path("baseline"), tmp_path) == ""  # not staged: this commit keeps no new decision
    subprocess.run(["git", "add", "baseline/decision.json.dvc"], cwd=tmp_path, check=True)
    trailer = commit_trailer(Path("baseline"), tmp_path)
    assert trailer.splitlines() == [
        f"Promoted: aaaaaaaaaaaa by Ada Lovelace at {decision['at']} (gate: regression)",
        "Accepted: the drop is a relabelled class", "Set aside: regression: REGRESSION: accuracy failed"]  # fmt: skip
    subprocess.run(["git", "-c", "user.email=a@b", "commit", "-qm", "kept"], cwd=tmp_path, check=True)
    assert commit_trailer(Path("baseline"), tmp_path) == ""  # committed: the next commit keeps nothing new
