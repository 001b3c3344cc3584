"""params.yaml is validated before any work: wrong keys, types and values name the key and the file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks.core.params import Params, ParamsError, derive_seed, load_params, parse_params
from tests.helpers.project import ROOT, env_with_venv

pytestmark = pytest.mark.fast  # unit-level: make test-fast


def test_repo_params_load_and_are_frozen() -> None:
    params = load_params(ROOT / "params.yaml")
    assert params.train.arch == "resnet18"
    with pytest.raises(Exception, match="frozen"):
        params.train.lr = 1.0  # type: ignore[misc]


def test_every_field_of_the_schema_is_written_in_params_yaml() -> None:
    """params.yaml is the documentation of every knob: no silent defaults."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())

    def keys(model: object, prefix: str = "") -> set[str]:
        out = set()
        for name in type(model).model_fields:
            value = getattr(model, name)
            out.add(prefix + name)
            if hasattr(type(value), "model_fields"):
                out |= keys(value, f"{prefix}{name}.")
        return out

    def raw_keys(node: dict, prefix: str = "") -> set[str]:
        out = set()
        for key, value in node.items():
            out.add(prefix + key)
            if isinstance(value, dict):
                out |= raw_keys(value, f"{prefix}{key}.")
        return out

    assert keys(Params()) <= raw_keys(raw)


@pytest.mark.parametrize(
    ("update", "expected"),
    [
        ({"train": {"lr_typo": 0.1}}, r"train\.lr_typo: unknown key$"),
        ({"train": {"epoch": 3}}, r"train\.epoch: unknown key; did you mean train\.epochs\?"),
        (
            {"train": {"augment": {"hflp": True}}},
            r"train\.augment\.hflp: unknown key; did you mean train\.augment\.hflip\?",
        ),
        ({"trian": {}}, r"trian: unknown key; did you mean train\?"),
        ({"train": {"lr": "fast"}}, r"train\.lr: .*valid number.*'fast'"),
        ({"train": {"lr": -1}}, r"train\.lr: .*greater than 0.*-1"),
        ({"train": {"arch": "VGG 99"}}, r"train\.arch: .*'VGG 99'"),
        ({"preprocess": {"val_fraction": 0.6, "test_fraction": 0.5}}, r"preprocess: .*leave images for training"),
        ({"generate": {"min_side": 300}}, r"generate: .*min_side \(300\) is larger than max_side"),
        ({"regression": {"rules": [{"metric": "accuracy", "direction": "up"}]}}, r"regression\.rules\.0\.direction"),
        ({"sed": 1}, r"sed: unknown key"),
    ],
)
def test_bad_params_name_the_key_and_file(update: dict, expected: str) -> None:
    with pytest.raises(ParamsError, match=r"my\.yaml: invalid params") as info:
        parse_params(update, "my.yaml")
    assert any(__import__("re").search(expected, line) for line in str(info.value).splitlines()), str(info.value)


def test_unreadable_params_file(tmp_path: Path) -> None:
    with pytest.raises(ParamsError, match="file not found"):
        load_params(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed")
    with pytest.raises(ParamsError, match="bad.yaml: not valid YAML"):
        load_params(bad)


def test_seeds_derive_from_one_seed() -> None:
    assert derive_seed(42, "train") == derive_seed(42, "train")
    assert len({derive_seed(42, "train"), derive_seed(43, "train"), derive_seed(42, "split")}) == 3
    assert 0 <= derive_seed(7, "x", 3) < 2**63


def test_stage_refuses_bad_params_before_any_work(tmp_path: Path) -> None:
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["train"]["epochs"] = 0
    raw["paths"]["model"] = str(tmp_path / "model.pt")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    proc = subprocess.run(
        [sys.executable, "-m", "tasks.train"],
        cwd=tmp_path,
        env={**env_with_venv(), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "params.yaml: invalid params" in proc.stderr and "train.epochs" in proc.stderr
    assert not (tmp_path / "model.pt").exists()


def test_a_stage_run_by_a_python_without_the_dependencies_names_the_venv(tmp_path: Path) -> None:
    """`.venv/bin/dvc repro` from a shell without the venv runs the stages with the system Python."""
    # -S: no site-packages, as a bare system interpreter has them
    proc = subprocess.run([sys.executable, "-S", "-m", "tasks.train"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert "lacks the pipeline's dependencies (numpy, yaml, pydantic" in proc.stderr
    assert "source .venv/bin/activate" in proc.stderr and "Traceback" not in proc.stderr


def test_dvc_exp_run_set_param_changes_only_the_value_it_sets(tmp_path: Path) -> None:
    """params.yaml is written in the style of DVC's own writer (what `dvc exp run -S` uses): block
    lists, empty for null, comments where it keeps them. So an experiment's diff is its values only."""
    from dvc.utils.hydra import apply_overrides

    original = (ROOT / "params.yaml").read_text()
    copy = tmp_path / "params.yaml"
    copy.write_text(original)
    apply_overrides(copy, ["seed=42"])  # a value set to what it already is: not one byte may move
    assert copy.read_text() == original
    apply_overrides(copy, ["train.lr=0.05", "data.source=/data/pets"])
    changed = [(a, b) for a, b in zip(original.splitlines(), copy.read_text().splitlines(), strict=True) if a != b]
    assert [(a.split("#")[0].strip(), b.split("#")[0].strip()) for a, b in changed] == [
        ("source: data/generated", "source: /data/pets"),
        ("lr: auto", "lr: 0.05"),
    ]
    assert all(a.split("#", 1)[1] == b.split("#", 1)[1] for a, b in changed if "#" in a)  # comments stay


def test_stage_processes_spin_briefly_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    import tasks

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    tasks.prepare_stage_process()
    assert os.environ["GOMP_SPINCOUNT"] == "10000"
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    tasks.prepare_stage_process()
    assert os.environ["GOMP_SPINCOUNT"] == "300000"  # the user's value wins
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    tasks.prepare_stage_process()
    assert "GOMP_SPINCOUNT" not in os.environ


def test_a_busy_machine_gets_a_warning(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from tasks.training import runtime

    monkeypatch.setattr(runtime.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(runtime.os, "getloadavg", lambda: (0.4, 0.3, 0.2))
    with caplog.at_level("WARNING", logger="tasks.training.runtime"):
        assert runtime.warn_if_cores_busy(2) == 0.4
    assert caplog.text == ""
    monkeypatch.setattr(runtime.os, "getloadavg", lambda: (2.1, 1.0, 0.5))
    with caplog.at_level("WARNING", logger="tasks.training.runtime"):
        runtime.warn_if_cores_busy(2)
    assert "load average 2.1 on 2 cores: other jobs are using the CPUs" in caplog.text
    assert "train.threads" in caplog.text
