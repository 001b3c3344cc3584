"""Two trainings on one machine: the seconds per step of a bare resnet18 step, alone and with a second
identical job at the same time, for each thread setting and OpenMP wait policy, side by side.

    .venv/bin/python -m bench.bench_shared_cores [--steps 12] [--batch 64]

Each case starts fresh interpreters (OpenMP reads its environment once, at start-up). Prints s/step
alone (median of 3 runs), s/step of each of the two concurrent jobs, and the slowdown (concurrent / alone): 2.0 is fair
sharing of the cores, more is threads waiting on each other.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, os, sys, time
threads, steps, batch, in_process = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
if in_process:  # as tasks/__init__.py does for the stages, before torch loads OpenMP
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
import torch, torchvision
torch.set_num_threads(threads)
torch.manual_seed(0)
model = torchvision.models.resnet18(num_classes=10)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x, y = torch.randn(batch, 3, 64, 64), torch.randint(0, 10, (batch,))
def step():
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
for _ in range(2):
    step()
print("ready", flush=True)
sys.stdin.readline()  # start together
start = time.perf_counter()
for _ in range(steps):
    step()
print(json.dumps({"s_per_step": (time.perf_counter() - start) / steps}), flush=True)
"""


def run_jobs(count: int, threads: int, env: dict[str, str], steps: int, batch: int, in_process: bool) -> list[float]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(threads), str(steps), str(batch), str(int(in_process))],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for _ in range(count)
    ]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    results = []
    for proc in procs:
        out, _ = proc.communicate()
        results.append(json.loads(out.strip().splitlines()[-1])["s_per_step"])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    cases = [
        (f"threads {cores}, OMP_WAIT_POLICY unset (spin)", cores, {}, False),
        (f"threads {cores}, OMP_WAIT_POLICY=PASSIVE", cores, {"OMP_WAIT_POLICY": "PASSIVE"}, False),
        (f"threads {cores}, GOMP_SPINCOUNT=10000 (the stages)", cores, {}, True),
        ("threads 1, spin", 1, {}, False),
    ]
    print(f"{cores} cores, resnet18 64x64 fp32, batch {args.batch}, {args.steps} timed steps; load before "
          f"{os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"{'case':48s} {'alone s/step':>12s} {'2 jobs s/step':>14s} {'slowdown':>9s}")
    for name, threads, extra, in_process in cases:
        unset = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")
        env = {k: v for k, v in os.environ.items() if k not in unset} | extra
        alone = statistics.median(run_jobs(1, threads, env, args.steps, args.batch, in_process)[0] for _ in range(3))
        time.sleep(1)
        both = run_jobs(2, threads, env, args.steps, args.batch, in_process)
        mean = sum(both) / len(both)
        print(f"{name:48s} {alone:12.3f} {f'{both[0]:.3f} {both[1]:.3f}':>14s} {mean / alone:8.2f}x")


if __name__ == "__main__":
    main()
