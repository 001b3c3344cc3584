"""The drift watch's false alarms, detection and cost, by number of classes and window size.

    .venv/bin/python bench/bench_drift.py                       # 10, 50, 100, 1000 classes; windows 200 and 500
    .venv/bin/python bench/bench_drift.py --classes 50 --windows 500 --trials 2000 --json out.json

A synthetic model population per number of classes K: a predicted class from a mildly unbalanced prior, a
top-1 probability and a margin that depend on the class. Its test split (10 x K images, at least 1,000) becomes
the model's drift reference through `build_reference` (`--test-images` sets its size), with thresholds
calibrated as export calibrates them (serve.drift: min_predictions 200, window 500, false_alarm_rate 0.01
unless given). Then, through the server's own `DriftWindow` with those thresholds:

- false alarms: fresh windows of traffic drawn from the same population (nothing changed), each filled to
  the window size and read as /drift reads it (the verdict, with its hysteresis from min_predictions on);
  printed with a 95% Wilson interval, beside the configured rate, and beside what a fixed PSI threshold
  (`--fixed`, 0.25: the thresholds before calibration) gives on the same windows;
- steady state: one long stream of such traffic through one sliding window, the verdict read once per window
  length (what a nightly reading /drift at a random time sees);
- detection: fresh windows where one class gained 20 points of the mix (shares x 0.8, that class + 0.2);
- cost: microseconds per `DriftWindow.add` on a full window (what each prediction pays), and the calibration's
  seconds (what export pays per ONNX file).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file: the project's packages
from tasks.core.params import DriftParams  # noqa: E402
from tasks.release.drift import DRIFT, DriftWindow  # noqa: E402
from tasks.release.drift_reference import REFERENCE_KEY, Reference, build_reference, reference_json  # noqa: E402
from tasks.release.drift_thresholds import DriftThresholds  # noqa: E402


class Population:
    """(class, top-1, margin) triples of a K-class model on data like its test split."""

    def __init__(self, classes: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.k = classes
        self.prior = rng.dirichlet(np.full(classes, 5.0))
        self.hardness = 2.0 + 6.0 * rng.random(classes)  # per-class confidence: Beta(1, hardness) of the error

    def draw(self, rng: np.random.Generator, n: int, prior: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        cls = rng.choice(self.k, size=n, p=self.prior if prior is None else prior)
        top1 = np.clip(1.0 - 0.9 * rng.beta(1.0, self.hardness[cls]), 1.0 / self.k + 1e-6, 1.0)
        second = rng.random(n) * np.minimum(top1, 1.0 - top1)
        return cls, top1, top1 - second

    def probs(self, cls: np.ndarray, top1: np.ndarray, margin: np.ndarray) -> np.ndarray:
        """Probability rows with these top-1 class, top-1 and margin (the rest spread evenly)."""
        n = len(cls)
        second = top1 - margin
        rest = np.clip(1.0 - top1 - second, 0.0, None) / max(self.k - 2, 1)
        probs = np.repeat(rest[:, None], self.k, axis=1)
        other = (cls + 1) % self.k
        probs[np.arange(n), cls] = top1
        probs[np.arange(n), other] = second
        return probs


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(centre - half, 0.0), min(centre + half, 1.0)


def fresh_rate(pop: Population, ref: Reference, thresholds: Sequence[DriftThresholds], window: int, trials: int,
               rng: np.random.Generator, prior: np.ndarray | None = None) -> list[int]:  # fmt: skip
    """How many of `trials` fresh windows filled to `window` read as drift, under each set of thresholds (the
    same windows for each)."""
    hits = [0] * len(thresholds)
    for _ in range(trials):
        windows = [DriftWindow(ref.classes, ref, th) for th in thresholds]
        cls, top1, margin = pop.draw(rng, window, prior)
        for c, t, m in zip(cls.tolist(), top1.tolist(), margin.tolist(), strict=True):
            for drift in windows:
                drift.add(c, t, m)
        hits = [h + (drift.verdict == DRIFT) for h, drift in zip(hits, windows, strict=True)]
    return hits


def sliding_rate(pop: Population, ref: Reference, thresholds: DriftThresholds, window: int, reads: int,
                 rng: np.random.Generator) -> tuple[int, int, float]:  # fmt: skip
    """One stream through one sliding window, read every `window` predictions: (drift reads, reads, us/add)."""
    drift = DriftWindow(ref.classes, ref, thresholds)
    cls, top1, margin = pop.draw(rng, window * (reads + 1))
    triples = list(zip(cls.tolist(), top1.tolist(), margin.tolist(), strict=True))
    for c, t, m in triples[:window]:
        drift.add(c, t, m)
    hits, spent = 0, 0.0
    for r in range(reads):
        chunk = triples[window * (r + 1) : window * (r + 2)]
        start = time.perf_counter()
        for c, t, m in chunk:
            drift.add(c, t, m)
        spent += time.perf_counter() - start
        hits += drift.verdict == DRIFT
    return hits, reads, spent / (window * reads) * 1e6


def measure(classes: int, window: int, params: DriftParams, trials: int, seed: int, test_size: int,
            fixed: float) -> dict[str, Any]:  # fmt: skip
    pop = Population(classes, seed)
    rng = np.random.default_rng(seed + 1)
    cls, top1, margin = pop.draw(rng, test_size)
    start = time.perf_counter()
    sizes = (params.min_predictions, window)
    built = build_reference(pop.probs(cls, top1, margin), [f"c{i}" for i in range(classes)], sizes=sizes,
                            false_alarm_rate=params.false_alarm_rate)  # fmt: skip
    calibration_s = time.perf_counter() - start
    names = [f"c{i}" for i in range(classes)]
    ref = Reference.from_metadata({REFERENCE_KEY: reference_json(built)}, names, "bench")
    assert ref is not None
    config = params.model_copy(update={"window": window})
    thresholds, _ = DriftThresholds.resolve(config, ref)
    fixed_thresholds = DriftThresholds.fixed(window, params.min_predictions, fixed)
    (false_hits, fixed_hits), n = fresh_rate(pop, ref, [thresholds, fixed_thresholds], window, trials, rng), trials
    steady_hits, reads, us_per_add = sliding_rate(pop, ref, thresholds, window, trials // 2, rng)
    gainer = int(np.argsort(pop.prior)[classes // 2])  # a class of middling share gains 20 points
    shifted = pop.prior * 0.8
    shifted[gainer] += 0.2
    m = max(trials // 5, 100)
    (detect_hits,) = fresh_rate(pop, ref, [thresholds], window, m, rng, shifted)
    return {
        "classes": classes, "window": window, "test_images": test_size, "false_alarm_rate": params.false_alarm_rate,
        "false_alarms": false_hits / n, "false_alarms_ci95": wilson(false_hits, n), "trials": n,
        "fixed_threshold": fixed, "fixed_false_alarms": fixed_hits / n,
        "steady_state_false_alarms": steady_hits / reads, "steady_state_reads": reads,
        "detection_20_points": detect_hits / m, "detection_trials": m,
        "us_per_prediction": round(us_per_add, 2), "calibration_s": round(calibration_s, 2),
        "thresholds": {s: round(thresholds.of(s, window), 4) for s in thresholds.limits},
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, nargs="+", default=[10, 50, 100, 1000])
    parser.add_argument("--windows", type=int, nargs="+", default=[200, 500])
    parser.add_argument("--trials", type=int, default=1000, help="fresh windows per false-alarm measurement")
    parser.add_argument("--false-alarm-rate", type=float, default=DriftParams().false_alarm_rate)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--test-images", type=int, nargs="+", default=[0],
                        help="test split sizes to try (0: max(1000, 10 x classes))")  # fmt: skip
    parser.add_argument("--fixed", type=float, default=0.25, help="the fixed PSI threshold measured beside (was 0.25)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    params = DriftParams(false_alarm_rate=args.false_alarm_rate)
    rows = []
    print(f"configured false-alarm rate {args.false_alarm_rate} per window; min_predictions {params.min_predictions}")
    fixed_head = f"fixed {args.fixed:g}"
    print(f"{'classes':>7} {'window':>6} {'test':>6} | {'false alarms (95% CI)':>24} {'steady':>7} "
          f"{fixed_head:>10} | {'detect +20pt':>12} | {'us/pred':>7} {'calib s':>7}")  # fmt: skip
    for classes, test, window in itertools.product(args.classes, args.test_images, args.windows):
        if window >= params.min_predictions:
            row = measure(classes, window, params, args.trials, args.seed, test or max(1000, 10 * classes),
                          args.fixed)  # fmt: skip
            rows.append(row)
            lo, hi = row["false_alarms_ci95"]
            steady, detect, fixed = (
                row["steady_state_false_alarms"],
                row["detection_20_points"],
                row["fixed_false_alarms"],
            )
            print(f"{classes:>7} {window:>6} {row['test_images']:>6} | {row['false_alarms']:>8.2%} "
                  f"({lo:.2%}-{hi:.2%}) {steady:>7.2%} {fixed:>10.1%} | {detect:>12.1%} | "
                  f"{row['us_per_prediction']:>7.2f} {row['calibration_s']:>7.2f}", flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
