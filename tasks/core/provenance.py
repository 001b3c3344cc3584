"""What a stage really ran and what it really made: its code against dvc.yaml, and the local run ledger.

- `undeclared_code`: project files this process loaded (every module under tasks/ in sys.modules, the
  package `__init__.py` files included) that the stage's deps in dvc.yaml do not cover, as a file or as a
  folder that holds it. `stage_main` checks it after the stage's imports, before any work, and again
  before the stage counts as done: a stage that runs code DVC does not watch stops, naming the file.
- `loaded_code`: those files -> md5, the code identity of what ran (train's checkpoint identity).
- The ledger (`<paths.runs>/ledger.jsonl`, untracked, never pushed): a line per stage that really ran in
  this workspace, with a digest of each output it wrote, the hash of its environment record and the time.
  Outputs that `dvc pull`, DVC's run cache or a checkout put here have no line: `recomputed` tells them
  apart, and `make check-reproduced` judges only what this workspace computed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from tasks.core.dag import DagError, load_stages
from tasks.core.paths import Paths

PACKAGE = "tasks"
LEDGER = "ledger.jsonl"


class ProvenanceError(ValueError):
    """dvc.yaml or params.yaml cannot say what a stage declares."""


def project_root() -> Path:
    return Path(__file__).resolve().parents[2]


@functools.lru_cache(maxsize=16)
def _parsed(path: Path, stamp: tuple[int, int]) -> Any:
    """A YAML file, parsed once per version of it (libyaml's loader where PyYAML has it): a stage asks for
    dvc.yaml and params.yaml several times, and every no-op `dvc repro` runs two stages."""
    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _load(path: Path) -> Any:
    stat = path.stat()
    return _parsed(path.resolve(), (stat.st_mtime_ns, stat.st_size))


def _params(root: Path) -> dict[str, Any]:
    try:
        return _load(root / "params.yaml") or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ProvenanceError(f"{root / 'params.yaml'}: cannot read it ({type(exc).__name__}: {exc})") from None


def declared(stage: str, root: Path) -> tuple[list[str], list[str]]:
    """A stage's deps (files and folders, not its params) and its outputs (outs, metrics and plots), as DVC
    resolves dvc.yaml (tasks/core/dag.py)."""
    try:
        spec = load_stages(root)[stage]
    except DagError as exc:
        raise ProvenanceError(str(exc)) from None
    except KeyError:
        raise ProvenanceError(f"{root / 'dvc.yaml'}: no stage {stage}") from None
    return list(spec.path_deps), list(spec.outs)


def _path_param(root: Path, key: str) -> str:
    """params.yaml's `paths.<key>` (a folder the stages write to)."""
    value = (_params(root).get("paths") or {}).get(key)
    if not isinstance(value, str):
        raise ProvenanceError(f"{root / 'params.yaml'}: paths.{key} is missing or not a path")
    return value


def loaded_files(root: Path) -> list[str]:
    """Every file under root/tasks that this process has imported, relative to root."""
    package = (root / PACKAGE).resolve()
    found = set()
    for name, module in list(sys.modules.items()):
        if name != "__main__" and name.partition(".")[0] != PACKAGE:
            continue  # the project's modules are `tasks.*`, and `python -m tasks.<stage>` runs as __main__
        file = getattr(module, "__file__", None)
        if not file:
            continue
        path = Path(file).resolve()
        if path.is_relative_to(package) and path.suffix == ".py":
            found.add(path.relative_to(root.resolve()).as_posix())
    return sorted(found)


def covered(file: str, deps: Iterable[str]) -> bool:
    """Is `file` one of `deps`, or under a folder among them?"""
    return any(file == d or file.startswith(d + "/") for d in deps)


def undeclared_code(stage: str, root: Path) -> list[str]:
    """Loaded project files that no dep of `stage` covers (the dep itself, or a folder above it)."""
    deps, _ = declared(stage, root)
    return [f for f in loaded_files(root) if not covered(f, deps)]


def undeclared_refusal(stage: str, root: Path, when: str) -> str | None:
    missing = undeclared_code(stage, root)
    if not missing:
        return None
    return (f"stage {stage} loaded {', '.join(missing)} {when}, which its deps in dvc.yaml do not cover: DVC "
            "would not rerun it when that code changes. Add the file (or its folder) to the stage's deps in "
            "dvc.yaml")  # fmt: skip


def md5_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def loaded_code(root: Path) -> dict[str, str]:
    """The project code this process runs: every loaded file under tasks/ -> its md5 (as dvc.lock records it)."""
    return {f: md5_file(root / f) for f in loaded_files(root)}


def stage_code(stage: str, root: Path) -> dict[str, str]:
    """The code `stage` runs: loaded project files that its deps cover -> md5. In a stage process that is all
    it loaded (stage_main refuses more); a test process that loaded other code leaves the rest out."""
    deps, _ = declared(stage, root)
    code = loaded_code(root)
    main = f"{PACKAGE}/{stage}.py"  # the stage's own module, also when a profiler or runner ran it as another name
    if (root / main).is_file():
        code.setdefault(main, md5_file(root / main))
    return {f: md5 for f, md5 in sorted(code.items()) if covered(f, deps)}


def declared_code(stage: str, root: Path) -> dict[str, str]:
    """Every Python file `stage`'s deps cover -> md5: all the code the stage may load, now or later in its run
    (stage_main refuses any other), whether or not it has loaded it yet."""
    files = set()
    for dep in declared(stage, root)[0]:
        path = root / dep
        if path.is_file() and path.suffix == ".py":
            files.add(dep)
        elif path.is_dir():
            files |= {f.relative_to(root).as_posix() for f in path.rglob("*.py") if "__pycache__" not in f.parts}
    return {f: md5_file(root / f) for f in sorted(files)}


def code_sha256(code: dict[str, str]) -> str:
    """One sha256 of a stage's code (file -> md5: `stage_code`, `declared_code`): what train's run identity,
    every rank's agreement and export's metadata each call the code version."""
    return hashlib.sha256(json.dumps(code, sort_keys=True).encode()).hexdigest()


def stage_code_sha256(stage: str, root: Path | None = None) -> str:
    """The code version of `stage` as this process runs it: `code_sha256(stage_code(stage, root))`."""
    return code_sha256(stage_code(stage, root or project_root()))


def digest(path: Path) -> str | None:
    """The hash DVC 3 records for `path` in dvc.lock, computed by DVC's own dvc-data with the project's
    .dvcignore: a file's md5; a folder's tree hash (`<md5>.dir`). None if absent."""
    if path.is_file():
        return md5_file(path)  # DVC 3's file hash is the plain md5 of the bytes
    if not path.is_dir():
        return None
    from dvc.fs import LocalFileSystem
    from dvc.ignore import DvcIgnoreFilter
    from dvc_data.hashfile.build import build
    from dvc_data.hashfile.db import HashFileDB
    from dvc_objects.fs.memory import MemoryFileSystem

    fs, folder = LocalFileSystem(), path.resolve()
    root = next((p for p in (folder, *folder.parents) if (p / ".dvc").is_dir()), None)
    if root is None:
        _, _, obj = build(HashFileDB(MemoryFileSystem(), "/odb"), str(folder), fs, "md5",
                          ignore=DvcIgnoreFilter(fs, str(folder)), dry_run=True)  # fmt: skip
        return str(obj.hash_info.value)
    from dvc.repo import Repo

    # DVC's own state database (file hashes by inode, mtime and size): a file DVC hashed before costs nothing
    # here, and one hashed here costs DVC nothing when it records the stage (a preprocess that linked its old
    # shards hashes only the new ones, twice over otherwise)
    with Repo(str(root)) as repo:
        odb = HashFileDB(MemoryFileSystem(), "/odb", state=repo.state)
        _, _, obj = build(odb, str(folder), fs, "md5", ignore=repo.dvcignore, dry_run=True)
    return str(obj.hash_info.value)


def environment_record(stage: str, root: Path) -> Path:
    return root / Paths(reports=Path(_path_param(root, "reports"))).environment_record(stage)


def ledger_path(root: Path) -> Path:
    return root / _path_param(root, "runs") / LEDGER


def record_run(stage: str, root: Path) -> dict[str, Any] | None:
    """Append that `stage` ran here: each output's digest, its environment record's sha256, the time.
    Nothing when an output is missing (a node that joined another's training writes none)."""
    _, outs = declared(stage, root)
    digests = {out: digest(root / out) for out in outs}
    if any(d is None for d in digests.values()):
        return None
    env = environment_record(stage, root)
    entry = {
        "stage": stage,
        "workspace": str(root.resolve()),  # a ledger copied or committed elsewhere vouches for nothing there
        "outs": digests,
        "environment_sha256": hashlib.sha256(env.read_bytes()).hexdigest() if env.is_file() else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "dvc_exp": os.environ.get("DVC_EXP_NAME") or None,
    }
    path = ledger_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:  # one write of one line: lines of two stages at once do not interleave
        f.write(json.dumps(entry, sort_keys=True) + "\n")
    return entry


def ledger(root: Path) -> list[dict[str, Any]]:
    path = ledger_path(root)
    if not path.is_file():
        return []
    entries = []
    for line in path.read_text().splitlines():
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a crash: that run is not vouched for
    return entries


def lock_digest(entry: dict[str, Any]) -> str:
    """A dvc.lock entry's content hash. DVC 3 writes `hash: md5` (the algorithm's name) beside `md5: <digest>`."""
    return str(entry.get(entry.get("hash", "md5")) or entry.get("md5") or entry.get("etag") or "")


def recomputed(root: Path, lock: dict[str, Any]) -> dict[str, bool]:
    """Per stage of `lock` (dvc.lock's stages): did a run of it in this workspace write the outputs the lock
    records? A ledger line of that stage, written in this folder, must hold every output's hash as dvc.lock
    has it. (That the files on disk are the lock's is DVC's own status, asked first.) A stage without outputs
    counts as run."""
    here = str(root.resolve())
    entries = [e for e in ledger(root) if e.get("workspace") == here]
    found = {}
    for stage, spec in lock.items():
        outs = {e["path"]: lock_digest(e) for e in spec.get("outs") or []}
        found[stage] = not outs or any(e.get("stage") == stage and e.get("outs") == outs for e in entries)
    return found


def not_recomputed(root: Path) -> tuple[list[str], list[str]]:
    """The stages whose outputs here no run in this workspace wrote (pulled, from the run cache, checked out),
    and those that always run (the environment check, the gate), which vouch for no upstream output."""
    always = [name for name, spec in load_stages(root).items() if spec.always_changed]
    made_here = recomputed(root, _load(root / "dvc.lock")["stages"])
    return [name for name, ok in made_here.items() if not ok and name not in always], always
