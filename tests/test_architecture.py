"""The import rules that keep the house walkable (README "Layout"), checked on the source itself.

- tasks/images/ and tasks/release/ never import torch or torchvision, directly or through another tasks
  module: preprocessing, the regression gate and serving run without the training stack;
- tasks/release/ never imports tasks/training/;
- serving/ never imports torch, torchvision, pyarrow, dvc or prefect, directly or through tasks/: the
  server runs from its own venv (serving/requirements.txt), which has none of them;
- tasks/core/ imports no other part of tasks/;
- nothing under tasks/ imports flows/ or serving/ (the stages know nothing of their orchestrators);
- tasks/ directly holds only the DAG's stage modules (each a `python -m tasks.<stage>` of dvc.yaml); the
  manual tools live in tasks/tools/, which no stage and no other room imports;
- flows/placement/: protocol.py imports no other piece, git.py only the protocol, and the sending side
  (send.py) and the receiving side (receive.py) never import each other;
- no test module imports another test module (shared code lives in tests/helpers/ and conftest.py);
- no import cycle among the modules of tasks/, type-only imports included (a cycle is two modules that are one
  idea, or a fact kept in the wrong one).
Every import counts, also one inside a function.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.project import ROOT
from tests.helpers.source import imports_of

pytestmark = pytest.mark.fast  # unit-level: make test-fast

TORCH = ("torch", "torchvision")
TRAINING_STACK = (*TORCH, "pyarrow", "dvc", "prefect")


def source_of(module: str, root: Path = ROOT) -> Path | None:
    for candidate in (root / (module.replace(".", "/") + ".py"), root / module.replace(".", "/") / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def reachable(path: Path, root: Path = ROOT) -> dict[str, Path]:
    """Every import of `path` and of the project modules it imports, transitively: name -> the file importing it."""
    found: dict[str, Path] = {}
    todo, seen = [path], {path}
    while todo:
        current = todo.pop()
        for name in imports_of(current):
            found.setdefault(name, current)
            nested = source_of(name, root) if name.split(".")[0] in {"tasks", "flows", "serving"} else None
            if nested is not None and nested not in seen:
                seen.add(nested)
                todo.append(nested)
    return found


def violations(package: str, forbidden: tuple[str, ...], root: Path = ROOT) -> list[str]:
    """`file imports name` for every module under `package` that reaches a forbidden top-level name."""
    out = []
    for path in sorted((root / package).rglob("*.py")):
        for name, importer in reachable(path, root).items():
            if name == forbidden or name.split(".")[0] in forbidden or any(name.startswith(f + ".") for f in forbidden):
                out.append(f"{path.relative_to(root)} reaches {name} (imported by {importer.relative_to(root)})")
    return sorted(set(out))


@pytest.mark.parametrize("package", ["tasks/images", "tasks/release"])
def test_image_and_release_code_never_imports_torch(package: str) -> None:
    assert violations(package, TORCH) == []


def test_serving_never_imports_the_training_stack() -> None:
    assert violations("serving", TRAINING_STACK) == []


def test_release_never_imports_training() -> None:
    assert violations("tasks/release", ("tasks.training",)) == []


def test_core_imports_no_other_part_of_tasks() -> None:
    stages = tuple(f"tasks.{p.stem}" for p in (ROOT / "tasks").glob("*.py") if p.name != "__init__.py")
    assert violations("tasks/core", ("tasks.images", "tasks.training", "tasks.release", *stages)) == []


def test_tasks_never_import_flows_or_serving() -> None:
    assert violations("tasks", ("flows", "serving")) == []


def test_no_test_module_imports_another() -> None:
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for name in imports_of(path)
        if name.startswith("tests.") and (name.split(".")[-1].startswith("test_") or ".conftest" in f".{name}")
    ]
    assert bad == []


def test_the_rule_catches_an_added_torch_import(tmp_path: Path) -> None:
    """The check above can fail: a copy of tasks/ with `import torch` added to tasks/images/shards.py."""
    copy = tmp_path / "tasks"
    subprocess.run(["cp", "-r", str(ROOT / "tasks"), str(copy)], check=True)
    shards = copy / "images" / "shards.py"
    shards.write_text(shards.read_text().replace("import numpy as np\n", "import numpy as np\nimport torch\n", 1))
    found = violations("tasks/images", TORCH, tmp_path)
    assert "tasks/images/shards.py reaches torch (imported by tasks/images/shards.py)" in found


def test_release_modules_load_without_torch_in_a_fresh_interpreter() -> None:
    """The same rule at run time: importing every release and images module loads no torch."""
    modules = [
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for package in ("tasks/images", "tasks/release")
        for p in sorted((ROOT / package).glob("*.py"))
        if p.name != "__init__.py"
    ]
    code = (
        f"import sys\nfor m in {modules!r}: __import__(m)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {TORCH!r}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def test_tasks_directly_holds_only_the_dags_stages() -> None:
    commands = [stage["cmd"] for stage in yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"].values()]
    stages = {match.group(1) for cmd in commands for match in [re.search(r"-m tasks\.(\w+)", cmd)] if match}
    modules = {p.stem for p in (ROOT / "tasks").glob("*.py") if p.name != "__init__.py"}
    assert modules == stages


@pytest.mark.parametrize("package", ["tasks/core", "tasks/images", "tasks/training", "tasks/release"])
def test_no_room_imports_the_manual_tools(package: str) -> None:
    assert violations(package, ("tasks.tools",)) == []


def test_no_stage_imports_the_manual_tools() -> None:
    bad = [f"{p.name} reaches {name}" for p in sorted((ROOT / "tasks").glob("*.py"))
           for name in reachable(p) if name == "tasks.tools" or name.startswith("tasks.tools.")]  # fmt: skip
    assert bad == []


@pytest.mark.parametrize(
    ("piece", "allowed"),
    [("protocol", set()), ("git", {"protocol"}), ("send", {"protocol", "git"}), ("receive", {"protocol", "git"})],
)
def test_placement_pieces_import_only_what_they_build_on(piece: str, allowed: set[str]) -> None:
    imported = {name.split(".")[2] for name in imports_of(ROOT / "flows" / "placement" / f"{piece}.py")
                if name.startswith("flows.placement.")}  # fmt: skip
    assert imported <= allowed, f"flows/placement/{piece}.py imports {sorted(imported - allowed)}"


def import_cycles(package: str, root: Path = ROOT) -> list[list[str]]:
    """The strongly connected groups of more than one module in `package`'s import graph (Tarjan's)."""
    modules = {".".join(p.relative_to(root).with_suffix("").parts): p for p in sorted((root / package).rglob("*.py"))}
    graph = {m: sorted(n for n in imports_of(p) if n in modules and n != m) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = [stack.pop()]
            while group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return groups


def test_no_import_cycle_in_tasks() -> None:
    assert import_cycles("tasks") == []


def test_the_cycle_rule_finds_a_type_only_cycle(tmp_path: Path) -> None:
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks/a.py").write_text("from tasks.b import f\n")
    (tmp_path / "tasks/b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tasks.a import g\n"
    )
    (tmp_path / "tasks/c.py").write_text("import tasks.a\n")
    assert import_cycles("tasks", tmp_path) == [["tasks.a", "tasks.b"]]
