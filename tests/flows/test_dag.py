"""tasks/core/dag.py reads the DAG the way `dvc repro` runs it: through DVC's own index, so templating,
`vars` and `foreach` resolve, and it works from any working directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tasks.core.dag import layers, load_stages
from tests.helpers.project import dvc, sh

pytestmark = pytest.mark.fast  # unit-level: make test-fast

DVC_YAML = """
vars:
  - shards: data/shards
stages:
  make:
    cmd: echo make
    deps: ["${src}"]
    outs: ["${shards}"]
  score:
    foreach: [a, b]
    do:
      cmd: echo "${item}"
      deps: ["${shards}"]
      outs: ["reports/${item}.json"]
  report:
    cmd: echo report
    deps: [reports/a.json, reports/b.json]
    metrics: [reports/summary.json]
"""


def test_templates_vars_and_foreach_resolve_from_elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    sh(["git", "init", "-q"], cwd=repo)
    dvc("init", "-q", cwd=repo)
    (repo / "dvc.yaml").write_text(DVC_YAML)
    (repo / "params.yaml").write_text("src: raw\n")
    (repo / "raw").mkdir()
    (repo / "raw" / "a.txt").write_text("a")
    dvc("add", "raw", cwd=repo)  # a .dvc file's stage is in DVC's graph too, and is no stage of dvc.yaml
    monkeypatch.chdir(tmp_path)  # not the repository: stage names must not become relative paths
    stages = load_stages(repo)
    assert list(stages) == ["make", "score@a", "score@b", "report"]
    assert stages["make"].deps == ("raw",) and stages["make"].outs == ("data/shards",)
    assert stages["score@b"].outs == ("reports/b.json",) and stages["score@b"].upstream == {"make"}
    assert stages["report"].upstream == {"score@a", "score@b"} and stages["report"].outs == ("reports/summary.json",)
    assert layers(stages) == [["make"], ["score@a", "score@b"], ["report"]]
    assert os.getcwd() == str(tmp_path)
