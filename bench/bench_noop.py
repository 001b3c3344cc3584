"""A no-op `dvc repro`: the seconds a rerun with nothing changed costs, beside DVC's own floor.

    .venv/bin/python -m bench.bench_noop [--repeats 5] [--keep DIR]

Makes a tiny copy of the project (tests/helpers/project.py's TINY params) as a git + DVC repository, runs
the pipeline once, then times `dvc repro` with nothing changed, `repeats` times, interleaved with DVC's
floor: a second repository whose dvc.yaml has the same stages, the same edges between them and the same
always-changed stages (environment, check_regression), but one file out per stage and commands that do
nothing (`echo`). Also timed: what runs inside the no-op on every call, the environment stage and the
gate's reuse of its scores. Prints the medians, the ratio to the floor, and JSON.
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

import yaml

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


def floor_project(repo: Path, at: Path) -> Path:
    """DVC's floor for `repo`'s DAG: its stages, edges and always-changed flags, with nothing to do."""
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    spec = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]
    made_by = {e["path"]: name for name, stage in lock.items() for e in stage.get("outs") or []}
    stages = {}
    for name, stage in lock.items():
        upstream = sorted({made_by[d["path"]] for d in stage.get("deps") or [] if d["path"] in made_by} - {name})
        entry: dict[str, object] = {"cmd": f"echo {name} > {name}.out", "outs": [f"{name}.out"]}
        if upstream:
            entry["deps"] = [f"{u}.out" for u in upstream]
        if spec[name].get("always_changed"):
            entry["always_changed"] = True
        stages[name] = entry
    at.mkdir(parents=True)
    subprocess.run(["git", "init", "-q"], cwd=at, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=at, check=True)
    (at / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    subprocess.run([sys.executable, "-m", "dvc", "repro", "-q"], cwd=at, check=True, capture_output=True)
    return at


def interleaved(commands: dict[str, tuple[list[str], Path]], repeats: int) -> dict[str, list[float]]:
    """Each command once per round, `repeats` rounds: load on the machine falls on all of them alike."""
    seconds: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(repeats):
        for name, (command, cwd) in commands.items():
            seconds[name] += timed(command, cwd, 1)
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
    floor = floor_project(repo, work / "floor")
    noop, floor_name = "dvc repro (no-op), this project", "dvc repro (no-op), DVC's floor: same DAG, empty stages"
    results = {
        **interleaved({noop: (dvc, repo), floor_name: (dvc, floor)}, args.repeats),
        "python -m tasks.environment": timed([sys.executable, "-m", "tasks.environment"], repo, args.repeats),
        "python -m tasks.check_regression (scores reused)": timed(
            [sys.executable, "-m", "tasks.check_regression"], repo, args.repeats
        ),
        "python -c pass": timed([sys.executable, "-c", "pass"], repo, args.repeats),
    }
    medians = {name: statistics.median(values) for name, values in results.items()}
    for name, value in medians.items():
        print(f"{name:<56} {value:6.2f} s  (median of {args.repeats})")
    ratio = medians[noop] / medians[floor_name]
    print(f"{'the no-op / the floor':<56} {ratio:6.2f} x")
    print(json.dumps({"medians_s": medians, "ratio_to_floor": ratio, "runs_s": results}, indent=1))


if __name__ == "__main__":
    main()
