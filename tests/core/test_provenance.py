"""A stage runs only the code DVC watches, and says what it made: tasks/core/provenance.py in real stage runs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks.core.provenance import digest, ledger, recomputed, record_run, undeclared_code, undeclared_refusal
from tests.helpers.project import ROOT, env_with_venv, make_project

pytestmark = pytest.mark.fast


def run_stage(repo: Path, stage: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", f"tasks.{stage}"], cwd=repo, capture_output=True, text=True,
                          env=env_with_venv())  # fmt: skip


def test_loaded_code_outside_the_deps_is_named_with_its_stage() -> None:
    import tasks.release.verdict  # noqa: F401  (loaded here; not under generate's deps)

    missing = undeclared_code("generate", ROOT)
    assert "tasks/release/verdict.py" in missing and "tasks/generate.py" not in missing
    assert "tasks/core/cli.py" not in missing  # under its folder dep, tasks/core
    refusal = undeclared_refusal("generate", ROOT, "before any work")
    assert refusal and refusal.startswith("stage generate loaded ") and "tasks/release/verdict.py" in refusal
    assert "Add the file (or its folder) to the stage's deps in dvc.yaml" in refusal


def test_a_stage_that_imports_undeclared_code_stops_before_work_or_before_it_is_done(tmp_path: Path) -> None:
    """A module-level import stops the stage before any work; an import inside the work (a lazy import) stops
    it before it counts as done: exit 2, one line naming the file and the stage, no ledger line."""
    repo = make_project(tmp_path / "repo")
    generate = repo / "tasks" / "generate.py"
    source = generate.read_text()
    planted = "import tasks.release.verdict  # noqa\n"
    top = "from __future__ import annotations\n"
    generate.write_text(source.replace(top, top + "\n" + planted, 1))
    early = run_stage(repo, "generate")
    assert early.returncode == 2, early.stdout + early.stderr
    assert "[generate] error: stage generate loaded tasks/release/__init__.py, tasks/release/" in early.stderr
    assert "tasks/release/verdict.py" in early.stderr
    assert "before any work" in early.stderr and not (repo / "data" / "generated").exists()
    body = "def _main(params: Params) -> None:\n"
    generate.write_text(source.replace(body, body + "    " + planted, 1))
    late = run_stage(repo, "generate")
    assert late.returncode == 2 and "tasks/release/verdict.py while it ran" in late.stderr, late.stdout + late.stderr
    assert ledger(repo) == []
    generate.write_text(source)
    done = run_stage(repo, "generate")
    assert done.returncode == 0, done.stderr
    [entry] = ledger(repo)
    assert entry["stage"] == "generate" and entry["workspace"] == str(repo.resolve())
    assert entry["outs"] == {"data/generated": digest(repo / "data" / "generated")}
    assert entry["environment_sha256"] is None  # the environment stage did not run: no record to hash


def test_the_ledger_vouches_only_for_the_bytes_it_saw_in_its_own_folder(tmp_path: Path) -> None:
    repo = make_project(tmp_path / "repo")
    out = repo / "data" / "generated"
    out.mkdir(parents=True)
    (out / "a.png").write_bytes(b"one")
    lock = {"generate": {"outs": [{"path": "data/generated", "hash": "md5", "md5": digest(out)}]}}
    assert recomputed(repo, lock) == {"generate": False}  # nothing ran here
    record_run("generate", repo)
    assert recomputed(repo, lock) == {"generate": True}
    other = {"generate": {"outs": [{"path": "data/generated", "hash": "md5", "md5": "0" * 32 + ".dir"}]}}
    assert recomputed(repo, other) == {"generate": False}  # the lock names bytes no run here wrote
    copy = tmp_path / "copy"
    (copy / "runs").mkdir(parents=True)
    (copy / "runs" / "ledger.jsonl").write_text((repo / "runs" / "ledger.jsonl").read_text())
    for name in ("dvc.yaml", "params.yaml"):
        (copy / name).write_text((repo / name).read_text())
    assert recomputed(copy, lock) == {"generate": False}  # a ledger copied (or committed) from elsewhere
    with open(repo / "runs" / "ledger.jsonl", "a") as f:
        f.write('{"stage": "gen')  # a line cut short by a crash
    assert recomputed(repo, lock) == {"generate": True} and len(ledger(repo)) == 1


def test_the_folder_digest_is_the_one_dvc_records() -> None:
    """The ledger's hashes are compared with dvc.lock's, so they must be DVC's: a file's md5, a folder's .dir hash."""
    lock = yaml.safe_load((ROOT / "dvc.lock").read_text())["stages"]
    folders = [d for d in lock["train"]["deps"] if d["path"].startswith("tasks/") and d["md5"].endswith(".dir")]
    assert folders, "train declares its code by package folder"
    for dep in folders:
        assert digest(ROOT / dep["path"]) == dep["md5"], dep["path"]
    [init] = [d for d in lock["train"]["deps"] if d["path"] == "tasks/__init__.py"]
    assert digest(ROOT / "tasks" / "__init__.py") == init["md5"]


def test_the_folder_digest_leaves_out_what_dvcignore_does(tmp_path: Path) -> None:
    """A stray `x.pyc` beside the code (not in `__pycache__/`) is in .dvcignore: DVC's hash leaves it out, so
    the ledger's must too, or a stage's record never matches dvc.lock."""
    repo = tmp_path / "repo"
    code = repo / "code"
    (code / "sub").mkdir(parents=True)
    (code / "a.py").write_text("x = 1\n")
    (code / "sub" / "b.py").write_text("y = 2\n")
    (code / "stray.pyc").write_bytes(b"\x00bytecode")
    (code / "__pycache__").mkdir()
    (code / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\x00more")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=repo, check=True)
    shutil.copy2(ROOT / ".dvcignore", repo / ".dvcignore")
    subprocess.run([sys.executable, "-m", "dvc", "add", "-q", "code"], cwd=repo, check=True, env=env_with_venv())
    recorded = yaml.safe_load((repo / "code.dvc").read_text())["outs"][0]["md5"]
    assert digest(code) == recorded


def dvc_repo(repo: Path) -> Path:
    """An empty git + DVC repository."""
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=repo, check=True)
    return repo


def test_declared_paths_are_dvcs_own_resolution_with_vars_and_foreach(tmp_path: Path) -> None:
    """dvc.yaml is resolved by DVC itself: `vars:` and `foreach` too, not only `${}` from params.yaml."""
    from tasks.core.provenance import declared

    repo = dvc_repo(tmp_path / "repo")
    (repo / "params.yaml").write_text("paths:\n  reports: out\n")
    (repo / "dvc.yaml").write_text(
        "vars:\n  - code: tasks/core\nstages:\n"
        "  make:\n    foreach: [a, b]\n    do:\n      cmd: echo ${item}\n"
        "      deps:\n        - ${code}\n      outs:\n        - ${paths.reports}/${item}.json\n"
    )
    assert declared("make@b", repo) == (["tasks/core"], ["out/b.json"])


def test_a_changed_vars_file_is_resolved_again(tmp_path: Path) -> None:
    """The kept resolution is keyed by every file DVC resolves dvc.yaml from, `vars:` files too."""
    from tasks.core.provenance import declared

    repo = dvc_repo(tmp_path / "repo")
    (repo / "params.yaml").write_text("seed: 1\n")
    (repo / "more.yaml").write_text("out: a.json\n")
    (repo / "dvc.yaml").write_text("vars:\n  - more.yaml\nstages:\n  s:\n    cmd: echo\n    outs:\n      - ${out}\n")
    assert declared("s", repo) == ([], ["a.json"])
    (repo / "more.yaml").write_text("out: b.json\n")
    assert declared("s", repo) == ([], ["b.json"])


def test_declared_code_is_every_python_file_the_stage_deps_cover_loaded_or_not(tmp_path: Path) -> None:
    """What every rank of a training compares (tasks/training/consistency.py): all the code the stage may load,
    so a module imported only later in the run, and different on one node, is caught before the first step."""
    from tasks.core.provenance import code_sha256, declared_code

    repo = dvc_repo(tmp_path / "repo")
    for name in ("pkg/a.py", "pkg/sub/b.py", "pkg/__pycache__/a.cpython-311.pyc", "one.py", "data.txt"):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(f"# {name}\n")
    (repo / "dvc.yaml").write_text(
        "stages:\n  s:\n    cmd: echo\n    deps:\n      - pkg\n      - one.py\n      - data.txt\n"
    )
    code = declared_code("s", repo)
    assert sorted(code) == ["one.py", "pkg/a.py", "pkg/sub/b.py"]
    (repo / "pkg/sub/b.py").write_text("# changed on one node\n")
    assert code_sha256(declared_code("s", repo)) != code_sha256(code)
