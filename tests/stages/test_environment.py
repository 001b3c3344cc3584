"""The environment stage: each stage's record, what moves it, and what leaves it alone."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
import yaml

from tasks.core.environment import (
    LIBRARIES,
    WRITES_NO_OUTPUT,
    cpu_capability,
    cpu_features,
    cpu_flags,
    may_have_cuda,
    native_bf16,
    off_pin,
    pinned,
)
from tasks.environment import resolve
from tests.helpers.project import ROOT
from tests.helpers.serving import PARAMS
from tests.helpers.source import imports_of, project_files

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


def test_every_library_a_stages_code_imports_is_in_its_record() -> None:
    """The record names every library whose code can write bytes into a stage's outputs: each third-party
    distribution that the stage's code (its module and the project modules it imports) imports is in
    LIBRARIES, or declared as writing none."""
    distributions = packages_distributions()
    for name, libraries in LIBRARIES.items():
        modules = {m.split(".")[0] for f in project_files(f"tasks.{name}", ROOT) for m in imports_of(f)}
        imported = {d.lower() for m in modules for d in distributions.get(m, [])}
        missing = imported - set(libraries) - set(WRITES_NO_OUTPUT)
        assert not missing, f"{name}: its code imports {sorted(missing)}, which its environment record does not name"


def test_the_torch_free_cpu_facts_are_torchs_own_answers() -> None:
    """The environment stage reads the CPU from /proc/cpuinfo by torch's rules; on this machine they must give
    what torch gives, as the train stage checks on every run."""
    import torch

    from tasks.core.private_api import cpu_native_bf16

    features = cpu_features()
    assert cpu_capability(features) in (None, torch.backends.cpu.get_cpu_capability())
    assert native_bf16(features) == cpu_native_bf16()
    assert cpu_capability({"avx2", "fma", "avx512f"}, "x86_64") == "AVX2"  # no avx512vl/bw/dq: not AVX512
    assert cpu_capability({"avx512vl", "avx512bw", "avx512dq", "fma", "avx2"}, "x86_64") == "AVX512"
    assert cpu_capability({"asimd", "sve"}, "aarch64") is None  # torch answers there
    assert cpu_flags(Path("/nonexistent")) == []


def test_aarch64_features_are_read(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes sve asimddp bf16 i8mm\n")
    assert cpu_flags(cpuinfo) == ["asimd", "asimddp", "sve", "bf16", "i8mm"]


def test_the_stage_imports_no_torch_on_a_machine_without_a_gpu() -> None:
    """A no-op `dvc repro` runs this stage every time: without a GPU in sight it must not pay torch's import."""
    if may_have_cuda() or cpu_capability(cpu_features()) is None:
        pytest.skip("a GPU or a non-x86 CPU: the stage asks torch here, by design")
    code = "import sys; from tasks.environment import resolve; from tasks.core.params import Params; " \
           "resolve(Params()); print('torch' in sys.modules)"  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "False"


def test_the_environment_stage_declares_each_train_and_export_key_it_reads() -> None:
    """It declares train and export key by key (a whole section would fill dvc.lock, which DVC rewrites on every
    no-op): every `t.<key>` (params.train) and `params.export.<key>` it reads is one of them."""
    source = (ROOT / "tasks" / "environment.py").read_text()
    read = {f"train.{k}" for k in re.findall(r"\bt\.(\w+)\b(?!\()", source)} | {
        f"export.{k}" for k in re.findall(r"\bparams\.export\.(\w+)", source)
    }
    declared = set(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["environment"]["params"])
    assert read and read <= declared, sorted(read - declared)
