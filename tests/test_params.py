"""params.yaml is validated before any work: wrong keys, types and values name the key and the file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks.params import Params, ParamsError, derive_seed, load_params, parse_params
from tests.conftest import ROOT, env_with_venv


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
        ({"train": {"lr_typo": 0.1}}, r"train\.lr_typo: unknown key"),
        ({"train": {"lr": "fast"}}, r"train\.lr: .*valid number.*'fast'"),
        ({"train": {"lr": -1}}, r"train\.lr: .*greater than 0.*-1"),
        ({"train": {"arch": "vgg99"}}, r"train\.arch: .*'vgg99'"),
        ({"preprocess": {"val_fraction": 0.6, "test_fraction": 0.5}}, r"preprocess: .*leave images for training"),
        ({"generate": {"min_side": 300}}, r"generate: .*min_side \(300\) is larger than max_side"),
        ({"regression": {"rules": [{"metric": "accuracy", "direction": "up"}]}}, r"regression\.rules\.0\.direction"),
        ({"sed": 1}, r"sed: unknown key"),
    ],
)
def test_bad_params_name_the_key_and_file(update: dict, expected: str) -> None:
    with pytest.raises(ParamsError, match=r"my\.yaml: invalid params") as info:
        parse_params(update, "my.yaml")
    assert info.match(expected)


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
