"""The train.imbalance candidates on long-tailed folders, against an RBF SVM with balanced class weights on HOG.

    flock /tmp/heavy.lock .venv/bin/python -m bench.bench_long_tail        # every folder, about 40 min on 2 cores
    .venv/bin/python -m bench.bench_long_tail --folders digits --candidates none logit_adjust --seeds 0
    .venv/bin/python -m bench.bench_long_tail --steps 1000     # the small-data recipe's full 1,000 steps (~5x longer)

Nothing downloads. Four long-tailed folders, each with a balanced fixed test folder (`data.test_source`, 30
images per class, drawn apart from the source):
- digits: real handwritten digits, scikit-learn's bundled `load_digits` (8x8, 16 grey levels, saved as 32x32 PNG,
  dark ink on white), 150 source images in the largest class down to 8 (19:1);
- glyphs: 10 scanned digits drawn by tests/helpers/folders.py, 150 down to 8 (19:1);
- textures: 6 two-colour patterns, 120 down to 8 (15:1);
- facing: 5 kinds of side view, all facing right, 120 down to 8 (15:1).
Class sizes fall exponentially (n_c = largest x ratio^(-c / (C - 1))); the train split is the source less its 10%
val split (content-hashed, so a rare class may keep one image more or less). Each candidate (none, class_balanced,
logit_adjust, balanced_sampler) trains with the pipeline's own stages (preprocess once per folder, then train and
evaluate) at `preprocess.image_size` 32 and params.yaml as it ships otherwise (flips by the mirror check), except
that the small-data recipe's 1,000 steps are cut to `--steps` (200: one run of 1,000 steps took 505 s on 2 shared
cores, and the bench trains 32 runs), with `seed` 0 and 1 (the train split stays; the training seed changes).
The anchor is bench_small_data's HOG features into an RBF SVC with class_weight="balanced", C by 5-fold grid
search on the train and val images. Printed per folder and candidate: balanced test accuracy (mean per-class
recall), the worst class's recall and the test ECE (15 bins, as served), mean ± standard deviation over the seeds.
`--candidates auto --steps 1000 --set preprocess.image_size=64`: params.yaml as it ships, the issue's check.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_finetune import pipeline  # noqa: E402
from bench.bench_small_data import hog_features, with_sets  # noqa: E402
from tasks.core.metrics import classification_metrics, worst_class  # noqa: E402
from tasks.core.params import Params, load_params  # noqa: E402
from tasks.images.shards import ShardSplit, class_counts  # noqa: E402
from tests.helpers.folders import draw_facing_folder, draw_glyph_folder, draw_texture_folder  # noqa: E402

CANDIDATES = ("none", "class_balanced", "logit_adjust", "balanced_sampler")
TEST_PER_CLASS = 30


def tail(classes: int, largest: int, smallest: int) -> list[int]:
    """Exponentially falling class sizes from `largest` to `smallest`."""
    return [round(largest * (smallest / largest) ** (c / (classes - 1))) for c in range(classes)]


def keep_first(root: Path, sizes: list[int]) -> Path:
    """Cut a drawn folder's classes (in name order) to `sizes` images each (the first ones by name)."""
    for folder, size in zip(sorted(p for p in root.iterdir() if p.is_dir()), sizes, strict=True):
        for extra in sorted(folder.iterdir())[size:]:
            extra.unlink()
    return root


def drawn(draw: Callable[[Path, int, int], Path], classes: int, largest: int, smallest: int) -> Any:
    def make(out: Path) -> tuple[Path, Path]:
        sizes = tail(classes, largest, smallest)
        source = keep_first(draw(out / "images", largest, 12), sizes)
        return source, draw(out / "test", TEST_PER_CLASS, 1000)

    return make


def real_digits(out: Path, largest: int = 150, smallest: int = 8) -> tuple[Path, Path]:
    """scikit-learn's 1,797 handwritten digits: 30 per class to the test folder, a long tail of the rest."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(0)
    sizes = tail(10, largest, smallest)
    order = rng.permutation(10)  # which digit is common and which rare: not the digit's value
    for rank, digit in enumerate(order.tolist()):
        members = rng.permutation(np.flatnonzero(digits.target == digit))
        parts = {"test": members[:TEST_PER_CLASS], "images": members[TEST_PER_CLASS:][: sizes[rank]]}
        for part, chosen in parts.items():
            folder = out / part / f"digit_{digit}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in chosen.tolist():
                ink = (255 - digits.images[i] * 255 / 16).clip(0, 255).astype(np.uint8)
                Image.fromarray(ink).resize((32, 32), Image.BILINEAR).save(folder / f"{i:04d}.png")
    return out / "images", out / "test"


FOLDERS: dict[str, Any] = {
    "digits": real_digits,
    "glyphs": drawn(lambda root, n, seed: draw_glyph_folder(root, per_class=n, seed=seed), 10, 150, 8),
    "textures": drawn(lambda root, n, seed: draw_texture_folder(root, per_class=n, seed=seed), 6, 120, 8),
    "facing": drawn(lambda root, n, seed: draw_facing_folder(root, per_class=n, seed=seed), 5, 120, 8),
}


def balanced_svm_on_hog(shards: Path, seed: int) -> dict[str, Any]:
    """The anchor's test metrics: fitted to the train and val splits with balanced class weights."""
    from sklearn.model_selection import GridSearchCV, StratifiedKFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from sklearn.svm import SVC

    fit = [ShardSplit.open(shards, name) for name in ("train", "val")]
    x = hog_features(np.concatenate([s.all_images() for s in fit]))
    y = np.concatenate([s.labels for s in fit])
    svc = SVC(kernel="rbf", gamma="scale", class_weight="balanced")
    search = GridSearchCV(make_pipeline(StandardScaler(), svc), {"svc__C": [1, 10, 100]},
                          cv=StratifiedKFold(5, shuffle=True, random_state=seed))  # fmt: skip
    search.fit(x, y)
    test = ShardSplit.open(shards, "test")
    predicted = search.predict(hog_features(test.all_images()))
    return classification_metrics(np.eye(len(test.class_names))[predicted], test.labels, test.class_names)


def shown(values: list[float]) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {spread:.3f}"


def bench_folder(p: Params, name: str, tmp: Path, candidates: list[str], seeds: list[int]) -> dict[str, Any]:
    source, test = FOLDERS[name](tmp / name)
    work = tmp / name / "run"
    scores: dict[str, list[tuple[float, float, float, float]]] = {}
    counts: list[int] = []
    for candidate in candidates:
        for seed in seeds:
            metrics, extra, seconds = pipeline(p.model_copy(update={"seed": seed}), source, work,
                                               {"imbalance": candidate}, test)  # fmt: skip
            worst = worst_class(metrics)
            assert worst is not None
            ece = metrics["calibration"]["ece"]
            scores.setdefault(candidate, []).append((metrics["balanced_accuracy"], worst[1], ece, seconds))
            train = ShardSplit.open(work / "shards", "train")
            counts = class_counts(train.labels, len(train.class_names))
            print(f"{name} {candidate} seed {seed}: balanced {metrics['balanced_accuracy']:.3f}, worst {worst[0]} "
                  f"{worst[1]:.3f}, ECE {ece:.3f} ({extra['run']['recipe']['summary']}; {seconds:.0f} s)",
                  flush=True)  # fmt: skip
    anchor = balanced_svm_on_hog(work / "shards", p.seed)
    return {"scores": scores, "anchor": anchor, "counts": counts}


def best(scores: dict[str, list[tuple[float, float, float, float]]]) -> str:
    """The candidate with the highest mean balanced accuracy over the seeds."""
    return max(scores, key=lambda c: statistics.mean(row[0] for row in scores[c]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folders", nargs="+", default=list(FOLDERS), choices=list(FOLDERS))
    parser.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=[*CANDIDATES, "auto"],
                        help="auto: params.yaml's own choice (recipe.imbalance_remedy on a long tail)")  # fmt: skip
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=200, help="train.recipe.small_min_steps (params.yaml: 1000)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a params override")
    args = parser.parse_args()
    sets = ["preprocess.image_size=32", f"train.recipe.small_min_steps={args.steps}", *args.set]
    p = with_sets(load_params(ROOT / "params.yaml"), sets)
    started = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        for name in args.folders:
            results[name] = bench_folder(p, name, Path(tmp_name), args.candidates, args.seeds)
    print()
    print(f"preprocess.image_size {p.preprocess.image_size}, {args.steps} steps, seeds {args.seeds}, overrides: "
          f"{' '.join(args.set) or 'none'}; {time.perf_counter() - started:.0f} s in all")  # fmt: skip
    print(f"{'folder':9} {'train counts':>14} {'candidate':16} {'balanced acc':>14} {'worst recall':>14} "
          f"{'vs SVM':>7} {'test ECE':>8} {'train s':>7}")  # fmt: skip
    for name, result in results.items():
        counts, anchor = result["counts"], result["anchor"]
        shape = f"{max(counts)}..{min(counts)}"
        for candidate, rows in result["scores"].items():
            balanced, worst, ece, seconds = (list(column) for column in zip(*rows, strict=True))
            print(f"{name:9} {shape:>14} {candidate:16} {shown(balanced):>14} {shown(worst):>14} "
                  f"{statistics.mean(balanced) - anchor['balanced_accuracy']:+7.3f} {statistics.mean(ece):8.3f} "
                  f"{statistics.mean(seconds):7.0f}")  # fmt: skip
        worst_anchor = worst_class(anchor)
        assert worst_anchor is not None
        print(f"{name:9} {shape:>14} {'SVM+HOG balanced':16} {anchor['balanced_accuracy']:14.3f} "
              f"{worst_anchor[1]:14.3f}")  # fmt: skip
    print()
    print("mean over folders (each folder's mean over seeds), and the folders where the candidate is best:")
    for candidate in args.candidates:
        means = [statistics.mean(r[0] for r in res["scores"][candidate]) for res in results.values()]
        worst = [statistics.mean(r[1] for r in res["scores"][candidate]) for res in results.values()]
        wins = [name for name, res in results.items() if best(res["scores"]) == candidate]
        print(f"  {candidate:16} balanced {statistics.mean(means):.3f}, worst recall {statistics.mean(worst):.3f}, "
              f"best on: {', '.join(wins) or '-'}")  # fmt: skip


if __name__ == "__main__":
    main()
