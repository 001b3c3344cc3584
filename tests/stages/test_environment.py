"""The environment stage: each stage's record, what moves it, and what leaves it alone."""

from __future__ import annotations

import pytest
import yaml

from tasks.core.environment import LIBRARIES, off_pin, pinned
from tasks.environment import resolve
from tests.helpers.project import ROOT
from tests.helpers.serving import PARAMS

pytestmark = pytest.mark.fast  # unit-level: make test-fast


def test_every_stage_gets_a_record_with_its_libraries() -> None:
    records = resolve(PARAMS)
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    assert set(records) == set(LIBRARIES) == set(stages) - {"environment"}
    for name, record in records.items():
        assert record["stage"] == name and set(record["libraries"]) == set(LIBRARIES[name])
    assert records["train"]["precision"] in ("fp32", "bf16") and records["train"]["threads"] >= 1


def test_what_moves_a_record_and_what_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DVC_EXP_NAME", "IMAGEPIPE_TRAIN_HOOKS", "IMAGEPIPE_ALLOW_TEST_HOOKS", "IMAGEPIPE_NATIVE_BF16"):
        monkeypatch.delenv(name, raising=False)
    base = resolve(PARAMS)
    assert "test_hooks" not in base["train"]
    # Whether the gate is enforced is decided when check_regression runs (always_changed), not recorded here.
    monkeypatch.setenv("DVC_EXP_NAME", "exp-1")
    assert resolve(PARAMS) == base and "gate" not in base["check_regression"]
    monkeypatch.delenv("DVC_EXP_NAME")
    monkeypatch.setenv("IMAGEPIPE_NATIVE_BF16", "1")
    forced = resolve(PARAMS)
    assert forced["train"]["precision"] == "bf16"
    assert {k: v for k, v in forced.items() if k != "train"} == {k: v for k, v in base.items() if k != "train"}
    monkeypatch.setenv("IMAGEPIPE_TRAIN_HOOKS", "/x/hooks.py")  # a test's run: part of train's key
    assert resolve(PARAMS)["train"]["test_hooks"] == {"module": "/x/hooks.py", "allowed": False}


def test_a_library_off_its_pin_is_named() -> None:
    pins = pinned(ROOT / "constraints.txt")
    assert pins["torch"] == "2.14.1"
    assert off_pin({"torch": "2.14.1"}, pins) == {}
    assert off_pin({"torch": "2.15.0"}, pins) == {"torch": "2.15.0 (constraints.txt pins 2.14.1)"}
