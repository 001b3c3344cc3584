"""Why a stage runs, from DVC's own status on a real repository, and the comparison of two runs."""

from __future__ import annotations

from pathlib import Path

import yaml

from flows.artifacts import flatten
from flows.explain import changed_leaves, comparison_markdown, manifest_from_table, why_stage_runs
from tasks.core import nested
from tests.helpers.project import dvc, sh


def small_repo(root: Path) -> Path:
    """A two-stage DVC pipeline with params, already run once."""
    root.mkdir()
    (root / "params.yaml").write_text(yaml.safe_dump({"train": {"lr": 0.1, "aug": {"flip": True}}, "seed": 1}))
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": {
        "prep": {"cmd": "cp raw.txt prep.txt", "deps": ["raw.txt"], "outs": ["prep.txt"]},
        "train": {"cmd": "cat prep.txt params.yaml > model.txt", "deps": ["prep.txt"], "params": ["train"],
                  "outs": ["model.txt"]},
    }}))  # fmt: skip
    (root / "raw.txt").write_text("data\n")
    sh(["git", "init", "-q"], cwd=root)
    dvc("init", "-q", cwd=root)
    dvc("repro", "-q", cwd=root)
    return root


def test_why_names_the_changed_param_leaf_the_changed_dep_and_a_missing_out(tmp_path: Path) -> None:
    repo = small_repo(tmp_path / "repo")
    assert why_stage_runs(repo, "prep") == [] and why_stage_runs(repo, "train") == []
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["train"]["lr"] = 0.02
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    assert why_stage_runs(repo, "train") == ["param train.lr: 0.1 -> 0.02"]
    assert why_stage_runs(repo, "prep") == []  # its deps did not change
    (repo / "raw.txt").write_text("other data\n")
    (repo / "model.txt").unlink()
    assert why_stage_runs(repo, "prep") == ["dep raw.txt modified"]
    assert set(why_stage_runs(repo, "train")) == {"param train.lr: 0.1 -> 0.02", "out model.txt deleted"}


def test_comparison_shows_deltas_changed_params_and_data() -> None:
    before = {"metrics": {"accuracy": 0.8, "loss": 0.5, "num_samples": 10}, "params": {"train": {"lr": 0.1}},
              "data_manifest_sha256": "a" * 64}  # fmt: skip
    after = {"metrics": {"accuracy": 0.9, "loss": 0.4, "num_samples": 10}, "params": {"train": {"lr": 0.02}},
             "data_manifest_sha256": "a" * 64}  # fmt: skip
    # The previous run comes back from its table artifact: flattened, then rebuilt.
    previous = manifest_from_table(flatten(before))
    assert previous == {**before, "metrics": before["metrics"]}
    text = comparison_markdown(after, previous, "run-1", {"accuracy": 0.85}, {"x.png": Path("/tmp/x.png")})
    assert "| accuracy | 0.9000 | 0.8000 | +0.1000 | 0.8500 | +0.0500 |" in text
    assert "| loss | 0.4000 | 0.5000 | -0.1000 | - |  |" in text
    assert "`train.lr: 0.1 -> 0.02`" in text and "**Data (shard manifest sha256):** unchanged" in text
    assert "[x.png](file:///tmp/x.png) (not written)" in text
    first = comparison_markdown(after, None, None, None, {})
    assert "No earlier completed run" in first and "No promoted baseline" in first


def test_leaves_and_changes() -> None:
    assert nested.flatten({"a": {"b": 1, "c": [1, 2]}}) == {"a.b": 1, "a.c": [1, 2]}
    assert changed_leaves({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 4}) == ["b: 2 -> 3", "c: (none) -> 4"]
