"""docs/troubleshooting.md lists every one-line error the project prints for a user mistake, checked on the source.

A user-facing error is one the project turns into one line instead of a traceback:
- `raise X(<message>)` where X is StageError, ParamsError (stage_main prints `[stage] error: <message>`),
  StageFailed or RegressionFound (a flow run's failure message), or a class derived from one of them, or
  a project exception class that an `except` clause turns into one of them (ModelIntegrityError, say);
- `raise ValueError(<message>)` in a pydantic validator: it becomes a line of `params.yaml: invalid params`;
- a string that starts with `error:` or `[name] error:` (what scripts, the server's launcher and the
  Prefect launcher print), and the returns of a `*_refusal` or `*_message` function (`refused: <message>`);
- an `echo "error: ..."` of the Makefile or of a shell script.
Each is known by the longest constant piece of its message (the text between placeholders), which must
appear in docs/troubleshooting.md. Files are found by walking tasks/, flows/, serving/ and scripts/, so
modules may move. Pure AST and text: no project module is imported.
"""

from __future__ import annotations

import ast
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.project import ROOT

pytestmark = pytest.mark.fast  # unit-level: make test-fast

SOURCE_DIRS = ("tasks", "flows", "serving", "scripts")
USER_ERRORS = {"StageError", "ParamsError", "StageFailed", "RegressionFound"}
VALIDATORS = {"field_validator", "model_validator"}
DOC = Path("docs") / "troubleshooting.md"
MESSAGE_FUNCTIONS = ("_refusal", "_message")  # functions that build a refusal or an error's text
MIN_KEY = 12  # shorter constant text (`str(exc)`, `f"{a}: {b}"`) says nothing a reader could look up
ERROR_PREFIX = re.compile(r"^(\[[\w-]+\] )?error:(\s|$)")
SHELL_ERROR = re.compile(r"""echo\s+"(error: (?:[^"\\]|\\.)*)\"""")
SHELL_PLACEHOLDER = re.compile(r"\$\([^)]*\)|\$\{[^}]*\}|\$\w+|\\`")


@dataclass(frozen=True)
class Message:
    where: str  # path:line, for the failure message
    key: str  # the longest constant piece: what the page must contain


def _pieces(node: ast.expr) -> list[str] | None:
    """The constant text of a message expression (split at its placeholders), or None when it is no string."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)] or [""]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _pieces(node.left), _pieces(node.right)
        return None if left is None and right is None else (left or []) + (right or [])
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "rstrip":
        return _pieces(node.func.value)
    return None


def _normal(text: str) -> str:
    return " ".join(text.replace("`", "").split())


def key_of(pieces: list[str]) -> str:
    """The longest piece, one line of it, without the `error:` prefix and edge punctuation."""
    lines = [line for piece in pieces for line in piece.splitlines()]
    best = max((ERROR_PREFIX.sub("", _normal(line)).strip(" :;,.()'\"") for line in lines), key=len, default="")
    return best if len(best) >= MIN_KEY else ""


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def _user_classes(trees: list[ast.Module]) -> set[str]:
    """USER_ERRORS, every class derived from one, and every project exception an except turns into one."""
    bases = {n.name: {_name(b) for b in n.bases} for t in trees for n in ast.walk(t) if isinstance(n, ast.ClassDef)}
    user = set(USER_ERRORS)
    while True:
        more = {name for name, parents in bases.items() if parents & user} - user
        for tree in trees:
            for handler in (n for n in ast.walk(tree) if isinstance(n, ast.ExceptHandler) and n.type is not None):
                raises = {_name(r.exc) for r in ast.walk(handler) if isinstance(r, ast.Raise) and r.exc is not None}
                if raises & user:
                    caught = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
                    more |= {_name(c) for c in caught if _name(c) in bases} - user
        if not more:
            return user
        user |= more


def _python_messages(path: Path, tree: ast.Module, user: set[str], root: Path) -> list[Message]:
    where = path.relative_to(root)
    found = []

    def add(node: ast.expr | None, line: int) -> None:
        pieces = _pieces(node) if node is not None else None
        if pieces is not None and (key := key_of(pieces)):
            found.append(Message(f"{where}:{line}", key))

    validators = {
        id(raise_)
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef) and {_name(d) for d in fn.decorator_list} & VALIDATORS
        for raise_ in ast.walk(fn)
        if isinstance(raise_, ast.Raise)
    }
    inside_fstrings = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
            cls = _name(node.exc)
            if cls in user or (cls == "ValueError" and id(node) in validators):
                add(node.exc.args[0], node.lineno)
        elif isinstance(node, ast.FunctionDef) and node.name.endswith(MESSAGE_FUNCTIONS):
            for ret in (r for r in ast.walk(node) if isinstance(r, ast.Return)):
                add(ret.value, ret.lineno)
        elif isinstance(node, (ast.Constant, ast.JoinedStr)) and id(node) not in inside_fstrings:
            first = node.values[0] if isinstance(node, ast.JoinedStr) and node.values else node
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and ERROR_PREFIX.match(first.value):
                add(node, node.lineno)
    return found


def _shell_messages(path: Path, root: Path) -> list[Message]:
    found = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        for match in SHELL_ERROR.finditer(line):
            if key := key_of(SHELL_PLACEHOLDER.split(match.group(1))):
                found.append(Message(f"{path.relative_to(root)}:{number}", key))
    return found


def user_errors(root: Path) -> list[Message]:
    """Every user-facing error message of the project under `root`."""
    files = sorted(p for d in SOURCE_DIRS for p in (root / d).rglob("*.py") if "__pycache__" not in p.parts)
    trees = [ast.parse(p.read_text(), filename=str(p)) for p in files]
    user = _user_classes(trees)
    found = [m for path, tree in zip(files, trees, strict=True) for m in _python_messages(path, tree, user, root)]
    shells = [root / "Makefile", *sorted(p for d in SOURCE_DIRS for p in (root / d).rglob("*.sh"))]
    return found + [m for path in shells if path.is_file() for m in _shell_messages(path, root)]


def quoted(doc: Path) -> list[str]:
    """The page's code spans (`...`, or ``...`` around a message holding a backtick), normalised."""
    return [_normal(m.group(2)) for m in re.finditer(r"(`+)(.+?)\1", doc.read_text(), re.S)]


def undocumented(root: Path, doc: Path) -> list[Message]:
    spans = quoted(doc)
    return [m for m in user_errors(root) if not any(_normal(m.key) in span for span in spans)]


def _report(missing: list[Message]) -> str:
    return f"{len(missing)} user-facing error(s) not in {DOC}; add each with its fix:\n" + "\n".join(
        f"  {m.where}: {m.key!r}" for m in missing
    )


def test_every_user_facing_error_is_in_troubleshooting() -> None:
    found = user_errors(ROOT)
    assert len(found) > 100, "the scanner finds the project's errors"  # a scanner that finds nothing passes anything
    missing = undocumented(ROOT, ROOT / DOC)
    assert not missing, _report(missing)


def test_a_new_error_without_an_entry_fails(tmp_path: Path) -> None:
    for name in SOURCE_DIRS:
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    (tmp_path / "tasks" / "brand_new.py").write_text(
        "from tasks.core.errors import StageError\n\n\n"
        "class BrandNewError(StageError):\n    pass\n\n\n"
        "def check(path):\n"
        '    raise StageError(f"{path}: a brand new problem that nobody documented")\n\n\n'
        "def other():\n"
        '    raise BrandNewError("another brand new problem, in a subclass")\n'
    )
    with (tmp_path / "Makefile").open("a") as makefile:
        makefile.write('\nbrand-new:\n\t@echo "error: a brand new make problem: $(X) is missing" >&2; exit 2\n')

    missing = undocumented(tmp_path, ROOT / DOC)

    assert {m.key for m in missing} == {
        "a brand new problem that nobody documented",
        "another brand new problem, in a subclass",
        "a brand new make problem",
    }, _report(missing)
    assert "tasks/brand_new.py:9" in _report(missing)
