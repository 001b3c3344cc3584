"""`make push` / `make pull`: `dvc push` / `dvc pull` with one clear line when they fail.

    .venv/bin/python scripts/dvc_sync.py push|pull [dvc args...]

DVC's own output streams through. On failure the last line says what went wrong in the user's terms:
no remote configured (and how to add one), a remote that cannot be reached or written (its name and
URL), or files the remote does not have (which ones, and where to push them from). Nothing local is
changed by a failed push; a failed pull leaves what was already there.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the project's packages

from tasks.core.private_api import dvc_remotes  # noqa: E402


def dvc(*args: str, capture: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dvc", *args], capture_output=capture, text=True)


def default_remote() -> tuple[str, str] | None:
    """The remote `dvc push` uses: the default one, or the only one (DVC's config, read through its API)."""
    remotes, chosen = dvc_remotes(Path.cwd())
    if chosen in remotes:
        return chosen, remotes[chosen]
    return next(iter(remotes.items())) if len(remotes) == 1 else None


def explain(command: str, output: str, remote: tuple[str, str]) -> str:
    name, url = remote
    missing = re.search(r"following targets:\s*\n(.+?)\n\s*Is your cache up to date", output, re.S)
    if command == "pull" and missing:
        targets = ", ".join(line.strip() for line in missing.group(1).splitlines() if line.strip())
        return (f"dvc pull: remote '{name}' ({url}) does not have the files of {targets}; push them from the "
                "machine that made them (`dvc push`), or rebuild them here with `dvc repro`")  # fmt: skip
    errors = [line.removeprefix("ERROR: ") for line in output.splitlines() if line.startswith("ERROR:")]
    reason = errors[-1] if errors else "see the output above"
    reason = re.sub(r"^(unexpected error|failed to \w+ data (to|from) the cloud) - ", "", reason)
    return f"dvc {command}: remote '{name}' ({url}) cannot be reached or written: {reason}; nothing local was changed"


def main() -> int:
    command, *rest = sys.argv[1:] or ["push"]
    remote = default_remote()
    if remote is None:
        print(f"error: dvc {command}: no DVC remote configured; add one: `dvc remote add -d storage <url>` "
              "(a folder, s3://bucket/path, ssh://host/path), then commit .dvc/config", file=sys.stderr)  # fmt: skip
        return 2
    proc = dvc(command, *rest)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    if proc.returncode == 0:
        return 0
    print(f"error: {explain(command, proc.stdout + proc.stderr, remote)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
