"""What make commit-run and make promote refuse (tasks/release/gate.py), and the override they name."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.release.gate import commit_refusal, hooks_refusal, promote_refusal

pytestmark = pytest.mark.fast  # unit-level: make test-fast

GATE = Path("reports/gate.json")


def gate(verdict: str, enforced: bool = True) -> dict[str, object]:
    return {"verdict": verdict, "passed": verdict == "pass", "enforced": enforced, "summary": f"the {verdict} line"}


def test_commit_run_takes_a_passing_enforced_record_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ALLOW_REGRESSION", raising=False)
    assert commit_refusal(gate("pass"), GATE, {"test_hooks": None}) is None
    assert commit_refusal(gate("no baseline"), GATE, {}) is None
    for verdict in ("regression", "different test set"):
        refusal = commit_refusal(gate(verdict), GATE, {})
        assert refusal == (f"reports/gate.json records verdict '{verdict}' (the {verdict} line); fix the model, or "
                           "commit it anyway with `make commit-run ALLOW_REGRESSION=1`")  # fmt: skip
    experiment = commit_refusal(gate("pass", enforced=False), GATE, {})
    assert (
        experiment is not None and "recorded by `dvc exp run`, which does not enforce it; run `make run`" in experiment
    )
    hooked = commit_refusal(gate("pass"), GATE, {"test_hooks": "/x/faults.py (sha256 ab)"})
    assert hooked is not None and "trained with test hooks (/x/faults.py (sha256 ab))" in hooked

    monkeypatch.setenv("ALLOW_REGRESSION", "1")  # the explicit override: a regression, never test hooks
    assert commit_refusal(gate("regression"), GATE, {}) is None
    assert commit_refusal(gate("pass"), GATE, {"test_hooks": "h"}) is not None


def test_promote_refuses_a_regression_not_another_test_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ALLOW_REGRESSION", raising=False)
    refusal = promote_refusal(gate("regression"), Path("reports/regression.json"))
    assert refusal is not None and refusal.endswith("To do it anyway: `make promote ALLOW_REGRESSION=1`")
    assert promote_refusal(gate("different test set"), Path("r")) is None  # what promote is for
    assert promote_refusal(gate("no baseline"), Path("r")) is None
    monkeypatch.setenv("ALLOW_REGRESSION", "1")
    assert promote_refusal(gate("regression"), Path("r")) is None
    assert hooks_refusal(None, "m") is None and "never the project's" in str(hooks_refusal("h", "models/model.onnx"))
