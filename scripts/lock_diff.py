"""Which stages and files of this run differ from a committed run: dvc.lock here vs dvc.lock at REV.

    .venv/bin/python scripts/lock_diff.py [REV]      # REV defaults to HEAD; `make check-reproduced` runs it

Prints one line per difference (`train: models/model.pt md5 1a2b... -> 3c4d...`, `export: dep
tasks/export.py changed`, `evaluate: params evaluate changed`) and exits 1 when there is any; exits 0
and says so when this run reproduced REV's record exactly. A difference in an output whose deps and
params are all equal is a reproducibility failure of that stage (other library versions, another
CPU); one that follows a changed dep is an ordinary change.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml


def _by_path(entries: list[dict[str, Any]] | None) -> dict[str, str]:
    return {e["path"]: e.get("md5") or e.get("hash", "") for e in entries or []}


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    lines = []
    for stage in sorted(set(old) | set(new)):
        if stage not in new or stage not in old:
            lines.append(f"{stage}: {'removed' if stage not in new else 'new'} stage")
            continue
        a, b = old[stage], new[stage]
        inputs = []
        deps_a, deps_b = _by_path(a.get("deps")), _by_path(b.get("deps"))
        inputs += [
            f"{stage}: dep {p} changed" for p in sorted(set(deps_a) | set(deps_b)) if deps_a.get(p) != deps_b.get(p)
        ]
        params_a, params_b = a.get("params", {}).get("params.yaml", {}), b.get("params", {}).get("params.yaml", {})
        inputs += [f"{stage}: params {s} changed" for s in sorted(set(params_a) | set(params_b))
                   if params_a.get(s) != params_b.get(s)]  # fmt: skip
        outs_a, outs_b = _by_path(a.get("outs")), _by_path(b.get("outs"))
        why = "" if inputs else " with the same deps and params: not reproduced"
        lines += inputs + [
            f"{stage}: {p} md5 {outs_a.get(p)} -> {outs_b.get(p)}{why}"
            for p in sorted(set(outs_a) | set(outs_b))
            if outs_a.get(p) != outs_b.get(p)
        ]
    return lines


def main() -> int:
    rev = sys.argv[1] if len(sys.argv) > 1 else "HEAD"
    shown = subprocess.run(["git", "show", f"{rev}:dvc.lock"], capture_output=True, text=True)
    if shown.returncode != 0:
        print(f"error: no dvc.lock at {rev}: {shown.stderr.strip()}", file=sys.stderr)
        return 2
    if not Path("dvc.lock").is_file():
        print("error: no dvc.lock here: run the pipeline first (make run)", file=sys.stderr)
        return 2
    old = yaml.safe_load(shown.stdout)["stages"]
    new = yaml.safe_load(Path("dvc.lock").read_text())["stages"]
    lines = differences(old, new)
    for line in lines:
        print(line)
    if lines:
        return 1
    print(f"dvc.lock reproduces {rev}: every stage's deps, params and outputs are the same")
    return 0


if __name__ == "__main__":
    sys.exit(main())
