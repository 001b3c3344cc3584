"""DVC's cache link types on this filesystem (issue 57, part 3): what each costs and what an edit in place does.

For each cache.type (reflink, hardlink, symlink, copy, and DVC's default "reflink,copy"), in a fresh git + DVC
repository in a temporary directory on the filesystem under test (`--dir`, default the system's temp dir):
`dvc add` of a folder of `--files` files of `--mb` MB of random bytes (about 200 MB), then
- whether it worked, and what DVC said (its ERROR / WARNING lines), and how the workspace files came out
  (symlink, hard link, or a file of its own: a copy, or a reflink, which st_ino cannot tell apart);
- the time of `dvc add`, and the disk used by workspace + cache counted by inode (st_ino), so that a hard link,
  or a symlink's target, counts once (a reflink's shared extents would count twice: inodes do not show them);
- `dvc checkout` time after deleting the workspace folder;
- an edit in place as a user's script would do it: open a workspace file 'r+b' and overwrite 16 bytes (DVC
  makes linked files read-only; root, as here in containers, writes anyway; a user who is refused is shown
  as such, then the bench makes the file writable and writes, as `chmod +w` would), then `dvc status`, whether
  the cache object still has the bytes its name (md5) says, and whether `dvc checkout --force` brings the
  original bytes back, and what `dvc status` says after it.

    .venv/bin/python -m bench.bench_links [--files 200] [--mb 1] [--dir /tmp] [--types hardlink copy ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

TYPES = ("reflink", "hardlink", "symlink", "copy", "reflink,copy")
EDIT = b"edited in place!"  # 16 bytes written over the start of one workspace file


@dataclass
class Outcome:
    kind: str
    added: bool = False
    said: str = ""
    layout: str = ""
    add_s: float = 0.0
    data_mb: float = 0.0
    used_mb: float = 0.0
    checkout_s: float | None = None
    checkout_failed: bool = False
    edit: str = ""
    status: str = ""
    status_after: str = ""
    cache_intact: bool | None = None
    restored: bool | None = None


def dvc(repo: Path, *args: str) -> tuple[int, str, float]:
    """(exit code, stdout + stderr, seconds) of `python -m dvc <args>` in `repo`."""
    start = time.perf_counter()
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    proc = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, capture_output=True, text=True, env=env)
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - start


def _untimed(line: str) -> str:
    return re.sub(r"^\d{4}-\d\d-\d\d [\d:,]+ \w+: ", "", line.strip())


def messages(output: str) -> str:
    """DVC's ERROR / WARNING lines, each with the lines that continue it (up to a blank line), and any OSError."""
    kept, keep = [], 0
    for line in map(_untimed, output.splitlines()):
        if line.startswith(("ERROR", "WARNING")) or "Errno" in line:
            keep = 3
        elif not line or line.startswith(("Traceback", "File ")):
            keep = 0
        if keep:
            kept.append(line)
            keep -= 1
    return " ".join(dict.fromkeys(kept))[:400]


def disk_used(*roots: Path) -> int:
    """Bytes allocated (st_blocks) under `roots`, each inode once; symlinks are not followed (a link's target
    in the cache is counted where it lies)."""
    seen: dict[tuple[int, int], int] = {}
    for root in roots:
        for folder, dirs, files in os.walk(root):
            for name in [*dirs, *files]:
                st = os.lstat(os.path.join(folder, name))
                seen[st.st_dev, st.st_ino] = st.st_blocks * 512
    return sum(seen.values())


def status(repo: Path) -> str:
    code, said, _ = dvc(repo, "status", "--json")
    try:
        return "modified" if json.loads(said.strip().splitlines()[-1]) else "up to date"
    except (json.JSONDecodeError, IndexError):
        return f"exit {code}: {said.strip()[-120:]}"


def layout(data: Path) -> str:
    files = sorted(data.iterdir())
    if all(p.is_symlink() for p in files):
        return "symlinks into the cache"
    if all(p.stat().st_nlink > 1 for p in files):
        return "hard links to the cache"
    if not any(p.is_symlink() or p.stat().st_nlink > 1 for p in files):
        return "files of their own (copy or reflink)"
    return "mixed"


def md5(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def measure(kind: str, root: Path, files: int, mb: int) -> Outcome:
    repo = root / kind.replace(",", "-")
    data = repo / "data"
    data.mkdir(parents=True)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    for args in (("init", "-q"), ("config", "core.analytics", "false"), ("config", "cache.type", kind)):
        code, out, _ = dvc(repo, *args)
        if code:
            raise SystemExit(f"dvc {' '.join(args)} failed in {repo}:\n{out}")
    for i in range(files):  # random bytes: nothing to deduplicate, each file its own cache object
        (data / f"file_{i:04d}.bin").write_bytes(os.urandom(mb << 20))
    out = Outcome(kind, data_mb=files * mb)
    code, said, out.add_s = dvc(repo, "add", "data")
    out.added, out.said = code == 0, messages(said) or ("" if code == 0 else said.strip()[-300:])
    if not out.added:
        return out
    out.layout = layout(data)
    cache = repo / ".dvc" / "cache"
    out.used_mb = disk_used(data, cache) / (1 << 20)

    shutil.rmtree(data)
    code, said, seconds = dvc(repo, "checkout")
    if code or not data.is_dir():
        _, verbose, _ = dvc(repo, "checkout", "-v")  # the reason is in the debug log only
        out.said = " ".join(filter(None, [out.said, f"checkout: {messages(said + verbose)}"]))
        out.checkout_failed = True
        return out
    out.checkout_s = seconds

    victim = data / "file_0000.bin"
    digest = md5(victim)
    cached = cache / "files" / "md5" / digest[:2] / digest[2:]
    try:
        with open(victim, "r+b") as handle:
            handle.write(EDIT)
        out.edit = "written (read-only mode ignored: root)" if os.geteuid() == 0 else "written"
    except PermissionError:
        victim.chmod(victim.stat().st_mode | 0o200)
        with open(victim, "r+b") as handle:
            handle.write(EDIT)
        out.edit = "refused (read-only); written after chmod +w"
    out.status = status(repo)
    out.cache_intact = cached.is_file() and md5(cached) == digest
    code, said, _ = dvc(repo, "checkout", "--force")
    out.restored = code == 0 and md5(victim) == digest
    out.status_after = status(repo)
    if code:
        out.said = " ".join(filter(None, [out.said, f"checkout --force: {messages(said)}"]))
    return out


def conclusion(o: Outcome) -> str:
    if not o.added:
        return "unusable here: dvc add refused it"
    double = o.used_mb > 1.5 * o.data_mb
    space = "stores the data twice (workspace + cache)" if double else "stores the data once"
    if o.checkout_failed:
        return (f"unusable here: dvc add succeeds without a word ({o.layout}; {space}), but dvc checkout fails "
                "and leaves the workspace folder missing (the cache keeps the data)")  # fmt: skip
    if o.cache_intact is False:
        silent = ", and dvc status then reports it up to date" if o.status_after == "up to date" else ""
        return (f"{space}; an edit in place CORRUPTS the cache object: checkout --force brings back the edited "
                f"bytes{silent}")  # fmt: skip
    return f"{space}; an edit in place changes only the workspace copy, and checkout --force restores it"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=200, help="files in the folder added")
    parser.add_argument("--mb", type=int, default=1, help="MB per file")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the temporary repositories go")
    parser.add_argument("--types", nargs="+", default=list(TYPES), help="cache.type values to try")
    args = parser.parse_args()

    fs = subprocess.run(["df", "-T", args.dir], capture_output=True, text=True).stdout.splitlines()[-1].split()
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="bench_links_", dir=args.dir) as tmp:
        for kind in args.types:
            outcomes.append(measure(kind, Path(tmp), args.files, args.mb))
            print(f"  {kind}: done", file=sys.stderr, flush=True)

    version = subprocess.run([sys.executable, "-m", "dvc", "--version"], capture_output=True, text=True).stdout
    print(f"\n### DVC cache link types: {args.files} files x {args.mb} MB in {args.dir} ({fs[0]}, {fs[1]})\n")
    print("| cache.type | dvc add | workspace files | add s | workspace+cache MB (by inode) | checkout s "
          "| edit in place ('r+b') | dvc status after | cache object intact | checkout --force restores "
          "| dvc status after checkout |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---|---|---|---|---|")
    for o in outcomes:
        if not o.added:
            print(f"| {o.kind} | failed | | {o.add_s:.1f} | | | | | | | |")
            continue
        intact = {True: "yes", False: "**no (corrupted)**", None: ""}[o.cache_intact]
        restored = {True: "yes", False: "**no**", None: ""}[o.restored]
        checkout = "**failed**" if o.checkout_failed else f"{o.checkout_s:.1f}"
        print(f"| {o.kind} | ok | {o.layout} | {o.add_s:.1f} | {o.used_mb:,.0f} of {o.data_mb:,.0f} data | "
              f"{checkout} | {o.edit} | {o.status} | {intact} | {restored} | {o.status_after} |")  # fmt: skip
    print()
    for o in outcomes:
        print(f"- {o.kind}: {conclusion(o)}." + (f" DVC said: {o.said}" if o.said else ""))
    print(f"\nDVC {version.strip()}, euid {os.geteuid()}")
    print(f"command: .venv/bin/python -m bench.bench_links {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
