"""dvc.yaml, params.yaml, tasks/ and flows/ agree: one declaration of the DAG, nothing drifting."""

from __future__ import annotations

import ast
import hashlib
import importlib
import re

import pytest
import yaml

from tasks.core.dag import layers, load_stages, upstream
from tasks.core.params import Params, load_params
from tasks.core.provenance import covered, digest, environment_record
from tests.helpers.project import ROOT

pytestmark = pytest.mark.fast  # unit-level: make test-fast

PIPELINE = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
STAGES = load_stages(ROOT)


def module_file(module: str) -> str | None:
    """tasks/core/params.py for tasks.core.params; None for a package (its __init__ is a docstring only)."""
    path = module.replace(".", "/") + ".py"
    return path if (ROOT / path).is_file() else None


def tasks_imports(module: str, seen: set[str] | None = None) -> set[str]:
    """tasks.* modules (files, not packages) imported by `module`, transitively."""
    seen = seen if seen is not None else set()
    tree = ast.parse((ROOT / module_file(module)).read_text())
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]  # `from tasks.training import loop`
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name.startswith("tasks.") and name not in seen and module_file(name):
                seen.add(name)
                tasks_imports(name, seen)
    return seen


def test_package_inits_hold_only_a_docstring() -> None:
    """What lets the code deps above skip the sub-packages' __init__.py: they run no code."""
    for init in (ROOT / "tasks").glob("*/__init__.py"):
        body = ast.parse(init.read_text()).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr), f"{init}: more than a docstring"


def sections_read_by_main(module: str) -> set[str]:
    """Params sections that the stage's main code reads (`p.<section>`)."""
    source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
    tree = ast.parse(source)
    bodies = [
        ast.get_source_segment(source, n) or ""
        for n in tree.body
        if isinstance(n, ast.FunctionDef) and n.name in ("main", "_main")
    ]
    reads = re.findall(r"\b(?:p|params)\.(\w+)(?:\.(\w+))?", "\n".join(bodies))
    return {f"{top}.{sub}" if sub else top for top, sub in reads if top in Params.model_fields}


def test_params_yaml_is_valid() -> None:
    load_params(ROOT / "params.yaml")


@pytest.mark.parametrize("name", sorted(PIPELINE))
def test_stage_module_matches_dvc_stage(name: str) -> None:
    stage = PIPELINE[name]
    assert stage["cmd"] == f"python -m tasks.{name}"
    module = importlib.import_module(f"tasks.{name}")
    assert callable(module.run) and callable(module.main)


@pytest.mark.parametrize("name", sorted(PIPELINE))
def test_declared_params_cover_what_the_stage_reads(name: str) -> None:
    declared = set(PIPELINE[name].get("params", []))  # a section, or one of its subsections (serve.drift)
    assert {d.split(".")[0] for d in declared} <= set(Params.model_fields), (
        f"{name}: declares sections that params.yaml does not have"
    )
    read = sections_read_by_main(f"tasks.{name}")
    missing = {r for r in read if not any(r == d or r.startswith(f"{d}.") for d in declared)}
    assert not missing, f"dvc.yaml stage {name} reads params {sorted(missing)} without declaring them"


@pytest.mark.parametrize("name", sorted(PIPELINE))
def test_code_deps_are_listed(name: str) -> None:
    """Every module the stage imports, read from the source, is under a code dep (the file or its folder).
    (The stage itself checks what it loaded at run time: tasks/core/provenance.py.)"""
    code = {module_file(m) for m in tasks_imports(f"tasks.{name}") | {f"tasks.{name}"}} | {"tasks/__init__.py"}
    listed = {d for d in STAGES[name].deps if d.startswith("tasks/")}
    uncovered = {f for f in code if not covered(f, listed)}
    assert not uncovered, f"dvc.yaml stage {name} does not list {sorted(uncovered)}"
    assert all((ROOT / d).exists() for d in listed), f"{name}: a listed code dep does not exist"


def test_templated_paths_resolve_to_params() -> None:
    params = load_params(ROOT / "params.yaml")
    outs = {o for s in STAGES.values() for o in s.outs}
    assert {str(params.paths.shards), str(params.paths.model), str(params.paths.onnx)} <= outs
    assert not any("${" in p for s in STAGES.values() for p in (*s.deps, *s.outs))


def test_flow_runs_every_stage_once_in_dependency_order() -> None:
    order = layers(STAGES)
    flat = [name for layer in order for name in layer]
    assert sorted(flat) == sorted(PIPELINE)
    position = {name: i for i, layer in enumerate(order) for name in layer}
    for name, before in upstream(STAGES).items():
        assert all(position[b] < position[name] for b in before)
    assert ["evaluate", "export"] in order  # independent stages run at the same time


def test_default_data_flows_from_generate_to_preprocess() -> None:
    assert "generate" in upstream(STAGES)["preprocess"]
    assert upstream(STAGES)["train"] == {"environment", "preprocess"}


def test_the_committed_dvc_lock_is_the_current_pipelines() -> None:
    """dvc.lock ships with the repository (a fresh clone's `make run` reproduces it, tested in the slow
    suite). It must describe this commit's code and params: a code or params edit without a new run
    would leave `dvc metrics diff` and a second machine's `dvc pull` comparing against a stale record."""
    lock_path = ROOT / "dvc.lock"
    assert lock_path.is_file(), "dvc.lock is not committed: run `make run && make commit-run`"
    lock = yaml.safe_load(lock_path.read_text())["stages"]
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert set(lock) == set(PIPELINE), f"dvc.lock has stages {sorted(lock)}, dvc.yaml {sorted(PIPELINE)}"
    stale = []
    for name, stage in lock.items():
        if stage["cmd"] != PIPELINE[name]["cmd"]:
            stale.append(f"{name}: cmd")
        for dep in stage.get("deps", []):
            if dep["path"].startswith("tasks/"):
                current = digest(ROOT / dep["path"]) or "missing"  # a file's md5, a folder's as DVC hashes it
                if current != dep["md5"]:
                    stale.append(f"{name}: {dep['path']}")
        listed = {d for d in STAGES[name].deps if d.startswith("tasks/")}
        if listed != {d["path"] for d in stage.get("deps", []) if d["path"].startswith("tasks/")}:
            stale.append(f"{name}: its code deps in dvc.yaml")
        for section, value in stage.get("params", {}).get("params.yaml", {}).items():
            current = params
            for part in section.split("."):  # a subsection: serve.drift
                current = current.get(part) if isinstance(current, dict) else None
            if current != value:
                stale.append(f"{name}: params {section}")
    assert not stale, f"dvc.lock is stale ({', '.join(stale)}): run `make run && make commit-run`"


def test_the_committed_gate_record_is_the_locked_one_enforced_and_accepted() -> None:
    """make commit-run refuses a failed or unenforced verdict, but a plain `git commit` does not run it: the
    committed reports/gate.json must be the one dvc.lock records, written by an enforced gate (not `dvc exp run`),
    with a verdict commit-run accepts."""
    from tasks.release.gate import ACCEPTED

    path = ROOT / "reports" / "gate.json"
    gate = yaml.safe_load(path.read_text())  # JSON is YAML
    lock = yaml.safe_load((ROOT / "dvc.lock").read_text())["stages"]["check_regression"]
    (locked,) = [out["md5"] for out in lock["outs"] if out["path"] == "reports/gate.json"]
    assert hashlib.md5(path.read_bytes()).hexdigest() == locked, "reports/gate.json is not the one dvc.lock records"
    assert gate["enforced"] is True, f"reports/gate.json was recorded by `dvc exp run` (not enforced): {gate}"
    assert gate["verdict"] in ACCEPTED, f"the committed verdict is {gate['verdict']!r}: {gate.get('summary')}"


def test_each_stage_reads_the_environment_record_the_environment_stage_writes_for_it() -> None:
    """One path per stage's record (Paths.environment_record): the environment stage writes it, the stage depends
    on it, and provenance, the run records and the summary read it there."""
    paths = Params().paths
    written = set(STAGES["environment"].outs)
    for name, stage in STAGES.items():
        if name == "environment":
            continue
        record = str(paths.environment_record(name))
        assert record in written and record in stage.deps, name
        assert environment_record(name, ROOT) == ROOT / record
    assert written == {str(paths.environment_record(n)) for n in STAGES if n != "environment"}
