"""train.warm_start against training from scratch, when the data has grown: accuracy and time.

    .venv/bin/python -m bench.bench_warm_start                    # about 35 min on 2 cores
    .venv/bin/python -m bench.bench_warm_start --per-class 300 --size 32   # a quicker look

Nothing downloads. The generate stage draws the default data's kind of folder (10 classes, `--per-class`
images each); the parent's dataset is that folder less `--grow` of it (the newest images, chosen by file name
hash), so the grown dataset is the parent's plus new images, as after `make add-data INTO=`. Both are
preprocessed at `--size` px with params.yaml's preprocess section (the split is the content hash: the grown
test split holds the parent's test images and the new ones, none the parent trained on). The parent trains
from scratch on the smaller set with params.yaml's train section; each arm then trains on the grown set:
from scratch and shrink-and-perturb (params.yaml's shrink and perturb) at the recipe's budget (train.epochs auto)
and at half of it, and a plain warm start (shrink 1, perturb 0) at half. Printed: the test accuracy on the
grown test split (mean over `--seeds` training seeds) and the training time, one row per arm.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tasks import generate, preprocess, train  # noqa: E402
from tasks.core.io import sha256_file, write_json  # noqa: E402
from tasks.core.params import GenerateParams, Params, WarmStartParams, load_params  # noqa: E402
from tasks.images.shards import ShardSplit  # noqa: E402
from tasks.training.models import load_model_file, split_logits  # noqa: E402
from tasks.training.warm_start import PARENT_MODEL, PARENT_RECORD  # noqa: E402


def folders(tmp: Path, per_class: int, grow: float, seed: int) -> tuple[Path, Path]:
    """The grown folder and the parent's (the grown one less `grow` of each class, by file-name hash)."""
    grown, older = tmp / "grown", tmp / "older"
    generate.run(GenerateParams(num_classes=10, images_per_class=per_class, workers=2), seed=seed, out_dir=grown)
    shutil.copytree(grown, older)
    for folder in sorted(p for p in older.iterdir() if p.is_dir()):
        files = sorted(folder.iterdir(), key=lambda f: hashlib.sha256(f.name.encode()).hexdigest())
        for path in files[: round(len(files) * grow)]:
            path.unlink()
    return grown, older


def fit(p: Params, shards: Path, out: Path, seed: int, **update: Any) -> tuple[Path, int, float]:
    """One training run: the model, its epochs and its seconds."""
    started = time.perf_counter()
    result = train.run(p.train.model_copy(update=update), seed=seed, shard_dir=shards, model_path=out / "model.pt",
                       history_path=out / "h.json", plot_path=out / "h.png", runs_dir=out / "runs", provenance={},
                       parent_dir=out.parent / "parent")  # fmt: skip
    return result.model_path, result.epochs, time.perf_counter() - started


def accuracy(model_path: Path, shards: Path) -> float:
    model, spec, _ = load_model_file(model_path)
    test = ShardSplit.open(shards, "test")
    return float((split_logits(model, test, spec).argmax(1) == np.asarray(test.labels)).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-class", type=int, default=600, help="images per class of the grown folder")
    parser.add_argument("--grow", type=float, default=0.1, help="the share of the grown folder that is new")
    parser.add_argument("--size", type=int, default=64, help="preprocess.image_size")
    parser.add_argument("--seeds", type=int, default=1, help="training seeds per arm")
    args = parser.parse_args()
    p = load_params(ROOT / "params.yaml")
    p = p.model_copy(update={"preprocess": p.preprocess.model_copy(update={"image_size": args.size})})
    sp = p.train.warm_start.model_copy(update={"enabled": True})
    plain = WarmStartParams(enabled=True, shrink=1.0, perturb=0.0)
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        grown, older = folders(tmp, args.per_class, args.grow, p.seed)
        shards = {}
        for label, folder in (("grown", grown), ("older", older)):
            shards[label] = tmp / f"{label}-shards"
            preprocess.run(p.preprocess, seed=p.seed, source=folder, out_dir=shards[label])
        parent_model, budget, seconds = fit(p, shards["older"], tmp / "arms" / "parent-run", p.seed)
        parent = tmp / "arms" / "parent"
        parent.mkdir(parents=True)
        shutil.copyfile(parent_model, parent / PARENT_MODEL)
        write_json(parent / PARENT_RECORD, {"model_sha256": sha256_file(parent / PARENT_MODEL), "source": "bench"})
        n_old, n_new = len(ShardSplit.open(shards["older"], "train")), len(ShardSplit.open(shards["grown"], "train"))
        print(f"parent: {n_old} training images, {budget} epochs, {seconds:.0f} s; test accuracy on the grown "
              f"test split {accuracy(parent_model, shards['grown']):.4f}; grown: {n_new} training images",
              flush=True)  # fmt: skip
        half = max(1, budget // 2)
        arms = [
            ("from scratch", budget, {}),
            (f"shrink-perturb {sp.shrink:g}/{sp.perturb:g}", budget, {"warm_start": sp}),
            ("from scratch", half, {}),
            (f"shrink-perturb {sp.shrink:g}/{sp.perturb:g}", half, {"warm_start": sp}),
            ("plain warm start (1/0)", half, {"warm_start": plain}),
        ]
        rows = []
        for number, (label, epochs, update) in enumerate(arms):
            accs, times = [], []
            for seed in range(args.seeds):
                model, _, took = fit(p, shards["grown"], tmp / "arms" / f"{number}-{seed}", p.seed + seed,
                                     epochs=epochs, **update)  # fmt: skip
                accs.append(accuracy(model, shards["grown"]))
                times.append(took)
            rows.append((label, epochs, statistics.mean(accs), accs, statistics.mean(times)))
            print(f"  {label}, {epochs} epochs: {statistics.mean(accs):.4f} {accs} in {statistics.mean(times):.0f} s",
                  flush=True)  # fmt: skip
    print(f"\n{args.per_class * 10} images at {args.size} px, {args.grow:.0%} new, {args.seeds} seed(s) per arm; "
          f"test accuracy on the grown test split\n")  # fmt: skip
    print("| start | epochs | test accuracy | per seed | train s |\n|---|---|---|---|---|")
    for label, epochs, mean, accs, took in rows:
        print(f"| {label} | {epochs} | {mean:.4f} | {', '.join(f'{a:.4f}' for a in accs)} | {took:.0f} |")


if __name__ == "__main__":
    main()
