"""Reading the project's source as the tests check it: the modules a file imports."""

from __future__ import annotations

import ast
from pathlib import Path


def imports_of(path: Path) -> set[str]:
    """Every module name `path` imports, also inside functions (`from a.b import c` gives a.b and a.b.c)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def project_files(module: str, root: Path) -> set[Path]:
    """The files of `module` (tasks.train) and of every project module it imports, transitively."""
    seen: set[Path] = set()
    todo = [module]
    while todo:
        path = root / (todo.pop().replace(".", "/") + ".py")
        if not path.is_file() or path in seen:
            continue  # a package (its __init__ is a docstring), a name inside a module, or done
        seen.add(path)
        todo += [name for name in imports_of(path) if name.split(".")[0] == module.split(".")[0]]
    return seen
