"""A no-op `dvc repro`: the seconds a rerun with nothing changed costs, and where they go.

    .venv/bin/python -m bench.bench_noop [--repeats 5] [--keep DIR]

Makes a tiny copy of the project (tests/helpers/project.py's TINY params) as a git + DVC repository, runs
the pipeline once, then times `dvc repro` with nothing changed, `repeats` times, side by side with what
runs inside it on every call: the environment stage (`python -m tasks.environment`), the gate's reuse of
its scores (`python -m tasks.check_regression`), and DVC's own share (the same repro with both stages' commands
timed apart). Prints the medians and JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers.project import env_with_venv, make_project  # noqa: E402


def timed(command: list[str], cwd: Path, repeats: int) -> list[float]:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(command, cwd=cwd, env=env_with_venv(), check=True, capture_output=True)
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--keep", type=Path, help="build the project here and keep it (default: a temp dir)")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench_noop_"))
    repo = make_project(work / "repo")
    subprocess.run([sys.executable, "-m", "dvc", "repro", "-q"], cwd=repo, env=env_with_venv(), check=True,
                   capture_output=True)  # fmt: skip
    dvc = [sys.executable, "-m", "dvc", "repro", "-q"]
    results = {
        "dvc repro (no-op)": timed(dvc, repo, args.repeats),
        "python -m tasks.environment": timed([sys.executable, "-m", "tasks.environment"], repo, args.repeats),
        "python -m tasks.check_regression (scores reused)": timed(
            [sys.executable, "-m", "tasks.check_regression"], repo, args.repeats
        ),
        "python -c pass": timed([sys.executable, "-c", "pass"], repo, args.repeats),
    }
    medians = {name: statistics.median(values) for name, values in results.items()}
    for name, value in medians.items():
        print(f"{name:<52} {value:6.2f} s  (median of {args.repeats})")
    print(json.dumps({"medians_s": medians, "runs_s": results}, indent=1))


if __name__ == "__main__":
    main()
