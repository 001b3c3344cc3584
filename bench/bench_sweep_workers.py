"""A sweep over machines, timed: the same study (4 trials of a tiny pipeline, no pruning) on one Prefect worker,
then on two, each worker in a clone of its own pinned to one core (the two "machines" of a 2-core box), the study
in a real PostgreSQL and the runs in a real MLflow server (tests/helpers/sweep_machines.py).

    .venv/bin/python -m bench.bench_sweep_workers [--trials 4]

Prints each sweep's wall time (`python -m flows.sweep_flow`, from its start to the comparison: dispatch, trials,
`dvc exp pull`) and the ratio. The Prefect server, MLflow and PostgreSQL share the same two cores.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from tests.helpers.sweep_machines import sweep_machines


def timed(workers: int, trials: int) -> float:
    cores = sorted(os.sched_getaffinity(0))
    pinned = [{cores[n % len(cores)]} for n in range(workers)]
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as work, sweep_machines(Path(work), workers, pinned) as m:
        started = time.monotonic()
        proc = m.sweep(trials=trials, parallel=workers, study=f"bench{workers}")
        seconds = time.monotonic() - started
        if proc.returncode != 0:
            raise SystemExit(f"the sweep on {workers} worker(s) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=4)
    args = parser.parse_args()
    one = timed(1, args.trials)
    print(f"one worker (one core): {args.trials} trials in {one:.0f} s", flush=True)
    two = timed(2, args.trials)
    print(f"two workers (one core each, two clones): {args.trials} trials in {two:.0f} s")
    print(f"speed-up: {one / two:.2f}x")


if __name__ == "__main__":
    main()
