"""The regression gate's false alarms on equal models, and its power, by class count and class size.

    .venv/bin/python bench/bench_gate.py                   # both tables, about 3 minutes on one core
    .venv/bin/python bench/bench_gate.py --runs 400 --power-runs 200 --seed 1

Two models are drawn image by image on a balanced test set of K classes x n images, each class at accuracy 0.9.
"Overlap" is the share of the baseline's errors the candidate makes too (0: independent errors; the issue's table
had 0 and 0.7); a wrong prediction goes to a random other class. Each run is judged by the real verdict code,
called as check_regression calls it: `compare(metrics, baseline metrics, params.yaml's default rules,
paired=Paired(...), alpha=0.05)` (accuracy, macro_f1 and per_class.*.recall; one family: Tarone's selection,
weighted Holm).

- equal models: the share of runs in which the gate fails at least one rule (must be <= alpha = 5%), with its
  Monte-Carlo standard error, and the mean share of rules not judged (too few images for their best level);
- power: the candidate loses L points of recall in one class (the rest as equal as above); the share of runs in
  which that class's rule fails, and the smallest L of the grid caught in >= 80% of runs;
- whole-test-set power: the candidate 4 points worse over all images; the share of runs the gate fails with the
  accuracy rule alone and with the default rules (adding rules must not make a real regression pass).
The metrics dicts are computed from the confusion matrix with evaluate's formulas (one-hot logits of 500,000
images x 1,000 classes would not fit); the gate itself is not re-implemented.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file: the project's packages
from tasks.core.metrics import confusion_matrix  # noqa: E402
from tasks.core.params import RegressionParams, Rule  # noqa: E402
from tasks.release.paired import Paired  # noqa: E402
from tasks.release.verdict import compare  # noqa: E402

ACCURACY = 0.9
CLASSES = (10, 50, 100, 1000)
SIZES = (20, 100, 500)
OVERLAPS = (0.0, 0.5, 0.9)
POWER_SIZES = (50, 100, 200, 500)
POWER_CLASSES = (10, 100, 1000)
POWER_OVERLAPS = (0.5, 0.9)
LOSSES = (0.05, 0.1, 0.15, 0.2, 0.3)


def metrics_of(labels: np.ndarray, predicted: np.ndarray, names: tuple[str, ...]) -> dict[str, Any]:
    """The keys the default rules read, as tasks/core/metrics.classification_metrics computes them."""
    matrix = confusion_matrix(labels, predicted, len(names))
    tp, support, guessed = np.diag(matrix).astype(float), matrix.sum(axis=1), matrix.sum(axis=0)
    precision = np.divide(tp, guessed, out=np.zeros_like(tp), where=guessed > 0)
    recall = np.divide(tp, support, out=np.zeros_like(tp), where=support > 0)
    f1 = np.divide(2 * precision * recall, precision + recall, out=np.zeros_like(tp), where=precision + recall > 0)
    r = lambda x: round(float(x), 6)  # noqa: E731
    return {"accuracy": r(tp.sum() / len(labels)), "macro_f1": r(f1.mean()), "num_samples": len(labels),
            "per_class": {n: {"recall": r(recall[i])} for i, n in enumerate(names)}}  # fmt: skip


def draw(rng: np.random.Generator, k: int, n: int, overlap: float, loss: float = 0.0) -> Paired:
    """Both models' predictions on k x n images: class 0 loses `loss` of recall in the candidate."""
    labels = np.repeat(np.arange(k), n)
    wrong = 1 - ACCURACY
    # per image: which of (both wrong, baseline only, candidate only) it is; class 0 gets the loss on right ones
    u = rng.random(labels.size)
    both = u < overlap * wrong
    base_only = (u >= overlap * wrong) & (u < wrong)
    extra = wrong * (1 - overlap) + np.where(labels == 0, loss, 0.0)  # candidate-only errors among baseline-right
    cand_only = (u >= wrong) & (u < wrong + extra)

    def wrong_class(mask: np.ndarray) -> np.ndarray:
        return (labels[mask] + 1 + rng.integers(0, k - 1, int(mask.sum()))) % k

    baseline, candidate = labels.copy(), labels.copy()
    baseline[both | base_only] = wrong_class(both | base_only)
    candidate[both] = baseline[both]  # a shared error is the same wrong class
    candidate[cand_only] = wrong_class(cand_only)
    return Paired(labels, candidate, baseline, tuple(f"c{i}" for i in range(k)))


def draw_whole(rng: np.random.Generator, k: int, n: int, drop: float, overlap: float) -> Paired:
    """Both models' predictions on k x n images: the candidate `drop` worse over the whole test set, sharing
    `overlap` of the baseline's errors (the same wrong class), its other errors on images the baseline got right."""
    labels = np.repeat(np.arange(k), n)
    base_wrong = rng.random(labels.size) < 1 - ACCURACY
    cand_wrong = base_wrong & (rng.random(labels.size) < overlap)
    extra = round((1 - ACCURACY + drop) * labels.size) - int(cand_wrong.sum())
    cand_wrong[rng.choice(np.flatnonzero(~base_wrong), size=max(0, extra), replace=False)] = True

    def wrong_class(mask: np.ndarray) -> np.ndarray:
        return (labels[mask] + 1 + rng.integers(0, k - 1, int(mask.sum()))) % k

    baseline, candidate = labels.copy(), labels.copy()
    baseline[base_wrong] = wrong_class(base_wrong)
    candidate[cand_wrong] = wrong_class(cand_wrong)
    shared = base_wrong & cand_wrong
    candidate[shared] = baseline[shared]
    return Paired(labels, candidate, baseline, tuple(f"c{i}" for i in range(k)))


def gate(paired: Paired, rules: Any) -> Any:
    names = paired.class_names
    labels = np.asarray(paired.labels)
    ours, theirs = (
        metrics_of(labels, np.asarray(paired.candidate), names),
        metrics_of(labels, np.asarray(paired.baseline), names),
    )
    return compare(ours, theirs, rules, paired=paired, alpha=0.05)


def runs_for(k: int, most: int) -> int:
    """Fewer runs at 1,000 classes: a verdict there checks 1,002 rules (about 0.15 s)."""
    return most if k <= 100 else max(20, most // 5)


def se_at(p: float, runs: int) -> float:
    """The Monte-Carlo standard error of a share p estimated from `runs` runs, in points."""
    return 100 * math.sqrt(p * (1 - p) / runs)


def equal_models(args: argparse.Namespace, rules: Any, rng: np.random.Generator) -> float:
    print("\n(a) equal models: share of runs in which the gate fails at least one rule (alpha 0.05 family-wise);")
    print("    'se': the Monte-Carlo standard error of a 5% share at that many runs; 'not judged': mean share of rules")
    print("    too small to judge at the best level the family can give them")
    cols = " ".join(f"{f'overlap {o:g}':>11}" for o in OVERLAPS)
    head = f"{'classes':>7} {'images/class':>12} {'runs':>5} {'se':>5}  {cols} {'not judged':>10}"
    print(head)
    print("-" * len(head))
    worst = 0.0
    for k in CLASSES:
        for n in SIZES:
            runs = runs_for(k, args.runs)
            cells, unjudged = [], []
            for overlap in OVERLAPS:
                failed = 0
                for _ in range(runs):
                    verdict = gate(draw(rng, k, n, overlap), rules)
                    failed += not verdict.passed
                    unjudged.append(len(verdict.too_few) / len(verdict.results))
                worst = max(worst, failed / runs)
                cells.append(f"{100 * failed / runs:10.1f}%")
            print(f"{k:>7} {n:>12} {runs:>5} {se_at(0.05, runs):5.1f}  " + " ".join(cells)
                  + f" {100 * np.mean(unjudged):9.0f}%")  # fmt: skip
    print(f"worst false-alarm share: {100 * worst:.1f}% (alpha 5%)")
    return worst


def caught_share(rng: np.random.Generator, k: int, n: int, overlap: float, loss: float, runs: int, rules: Any) -> float:
    """The share of runs in which the rule of the class that lost `loss` fails."""
    caught = 0
    for _ in range(runs):
        verdict = gate(draw(rng, k, n, overlap, loss), rules)
        caught += not next(r for r in verdict.results if r.metric == "per_class.c0.recall").passed
    return caught / runs


def power(args: argparse.Namespace, rules: Any, rng: np.random.Generator) -> None:
    print("\n(b) power: one class loses L points of recall (from 0.9), the rest as equal models; the share of runs in")
    print("    which that class's rule fails (grid stops at the first L caught in >= 80% of runs)")
    cols = " ".join(f"{f'L={x:g}':>6}" for x in LOSSES)
    head = f"{'classes':>7} {'images/class':>12} {'overlap':>7} {'runs':>5}  {cols}  smallest caught"
    print(head)
    print("-" * len(head))
    for k in POWER_CLASSES:
        for n in POWER_SIZES:
            for overlap in POWER_OVERLAPS:
                runs = runs_for(k, args.power_runs)
                cells, smallest = [], "none"
                for loss in LOSSES:
                    rate = caught_share(rng, k, n, overlap, loss, runs, rules)
                    cells.append(f"{100 * rate:5.0f}%")
                    if rate >= 0.8:
                        smallest = f"{loss:g}"
                        break
                cells += [f"{'-':>6}"] * (len(LOSSES) - len(cells))
                print(f"{k:>7} {n:>12} {overlap:>7g} {runs:>5}  " + " ".join(cells) + f"  {smallest:>15}")
    print(f"(Monte-Carlo standard error of an 80% share: {se_at(0.8, args.power_runs):.0f} points at "
          f"{args.power_runs} runs, {se_at(0.8, runs_for(1000, args.power_runs)):.0f} at "
          f"{runs_for(1000, args.power_runs)})")  # fmt: skip
    runs = args.runs
    print(f"\nthe issue's case: a 10-point loss in one class of 200 test images, 100 classes ({runs} runs, se "
          f"{se_at(0.8, runs):.0f} points at 80%): share of runs failing that class's rule, by overlap")  # fmt: skip
    for overlap in (0.0, 0.5, 0.7, 0.9, 1.0):
        print(f"  overlap {overlap:g}: {100 * caught_share(rng, 100, 200, overlap, 0.1, runs, rules):.0f}%")


def whole_power(args: argparse.Namespace, rules: Any, rng: np.random.Generator) -> None:
    print("\n(c) power for a whole-test-set regression: the candidate 4 points worse over all images (tolerance 2),")
    print("    sharing 70% of the baseline's errors; the share of runs in which the gate fails, by rule set (the same")
    print("    draws for both)")
    alone = (Rule(metric="accuracy", abs_tol=0.02),)
    head = f"{'classes':>7} {'images/class':>12} {'runs':>5}  {'accuracy alone':>14} {'default rules':>13}"
    print(head)
    print("-" * len(head))
    for k, n in ((10, 50), (10, 100), (50, 20), (50, 100), (100, 20), (100, 50)):
        runs = runs_for(k, args.power_runs * 5)
        draws = [draw_whole(rng, k, n, 0.04, 0.7) for _ in range(runs)]
        shares = [np.mean([not gate(p, chosen).passed for p in draws]) for chosen in (alone, rules)]
        print(f"{k:>7} {n:>12} {runs:>5}  {100 * shares[0]:13.0f}% {100 * shares[1]:12.0f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=100, help="runs per equal-models cell (fewer on big test sets)")
    parser.add_argument("--power-runs", type=int, default=40, help="runs per power cell (fewer on big test sets)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=("equal", "power", "whole"), default=None)
    args = parser.parse_args()
    rules = RegressionParams().rules
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    print(f"rules: {', '.join(r.metric for r in rules)}; class accuracy {ACCURACY}; seed {args.seed}")
    if args.only in (None, "equal"):
        equal_models(args, rules, rng)
    if args.only not in ("equal", "whole"):
        power(args, rules, rng)
    if args.only in (None, "whole"):
        whole_power(args, rules, rng)
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
