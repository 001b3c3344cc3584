"""The default recipe from scratch against a classical baseline (an RBF SVM on HOG features), on small folders.

    .venv/bin/python -m bench.bench_small_data                      # every folder, about 10 min on 2 cores
    .venv/bin/python -m bench.bench_small_data --folders shapes     # one
    .venv/bin/python -m bench.bench_small_data --set train.label_smoothing=0.1   # a variant of the recipe
    .venv/bin/python -m bench.bench_small_data --mirror             # hflip auto's decision on eight kinds of folder

Nothing downloads: each folder is drawn here (tests/helpers/folders.py), different in kind:
- glyphs: 1,800 scanned digits, 10 classes, grey ink and paper of any two shades, on canvases up to 6:1 (squashed
  to the square input), rotated, blurred and noisy;
- scans: the same, and half of them tinted as coloured paper and ink are (RGB files);
- real_digits: real handwritten digits, scikit-learn's bundled `load_digits` (1,797 scans of 8x8 pixels, no
  download), as a messy folder (each upscaled to 16-96 px, half RGB on tinted paper, PNG or JPEG): 1,200 in the
  source, the other 597 the test folder;
- shapes: 180 drawings of 3 shapes, small and off-centre on noisy canvases crossed by lines (the hard case);
- textures: 600 two-colour patterns, 6 kinds, at any scale, angle and phase.
Each is preprocessed and trained by the pipeline's own stages with params.yaml as it ships, only `data.source`
changed, and `data.test_source` set to a fixed folder of other drawings of the same classes (300 images, 600 for
glyphs and scans), because a 10% test split of 180 images is 18 images. The baseline is fitted to the same train and val
images and scored on the same test images: scikit-image's HOG of the 32x32 grey image (4x4-pixel cells, 9
orientations, 2x2 blocks; ink made dark on a light border, as the baseline of the issue did) into scikit-learn's
RBF SVC, C chosen by 5-fold grid search on the training images.

`--mirror` resolves `augment.hflip: auto` on each kind of folder as the train stage does (tasks/training/start.py):
the mirror check, and where it cannot tell on small data, the paired training probe (tasks/training/flip_probe.py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_finetune import pipeline  # noqa: E402
from tasks import preprocess  # noqa: E402
from tasks.core.params import Params, load_params  # noqa: E402
from tasks.images.shards import ShardSplit  # noqa: E402
from tests.helpers.folders import (  # noqa: E402
    draw_facing_folder,
    draw_glyph_folder,
    draw_offcentre_folder,
    draw_shapes_folder,
    draw_texture_folder,
    write_digits_folder,
)

FOLDERS: dict[str, Any] = {  # name -> (draw(root, scale, seed), images in the source, images in the test folder)
    "glyphs": (
        lambda root, n, seed: draw_glyph_folder(root, per_class=n // 10, seed=seed, max_ratio=6.0, any_shade=True),
        1800,
        600,
    ),  # fmt: skip
    "shapes": (
        lambda root, n, seed: draw_offcentre_folder(
            root, classes=3, per_class=n // 3, seed=seed, max_ratio=2.0, cluttered=True
        ),
        180,
        300,
    ),  # fmt: skip
    "textures": (lambda root, n, seed: draw_texture_folder(root, per_class=n // 6, seed=seed), 600, 300),
    "scans": (
        lambda root, n, seed: draw_glyph_folder(
            root, per_class=n // 10, seed=seed, max_ratio=6.0, any_shade=True, any_colour=True
        ),
        1800,
        600,
    ),  # fmt: skip
    "real_digits": (lambda root, n, seed: real_digits(root, test=seed == 1000), 1200, 597),
}
MIRROR_FOLDERS: dict[str, Any] = {
    "letters with mirror pairs": lambda root: draw_glyph_folder(root, per_class=100, seed=2, glyphs="bdpqaehk"),
    "digits": lambda root: draw_glyph_folder(root, per_class=150, seed=1),
    "one-way-facing objects": lambda root: draw_facing_folder(root, per_class=100, seed=1),
    "symmetric shapes": lambda root: draw_shapes_folder(root, classes=6, per_class=60, seed=1),
    "shapes in clutter": lambda root: draw_offcentre_folder(
        root, classes=3, per_class=60, seed=1, max_ratio=2.0, cluttered=True
    ),  # fmt: skip
    "textures": lambda root: draw_texture_folder(root, per_class=100, seed=1),
    "digits drawn like scans": lambda root: draw_glyph_folder(
        root, per_class=100, seed=1, max_ratio=6.0, any_shade=True, any_colour=True
    ),
    "real digits (load_digits)": lambda root: write_digits_folder(root, seed=1),
}


def real_digits(root: Path, test: bool) -> Path:
    """1,200 of load_digits' 1,797 (a seeded draw) as the source, the other 597 as the fixed test folder."""
    order = np.random.default_rng(0).permutation(1797)
    return write_digits_folder(root, seed=2 if test else 1, indices=np.sort(order[1200:] if test else order[:1200]))


def hog_features(images: np.ndarray) -> np.ndarray:
    """uint8 (N, 3, S, S) -> HOG of the 32x32 grey image, ink dark on a light border."""
    from skimage.feature import hog

    from tasks.training.mirror import thumbnails

    out = []
    for grey in thumbnails(images).mean(1):
        border = np.concatenate([grey[0], grey[-1], grey[:, 0], grey[:, -1]]).mean()
        if border < grey[8:24, 8:24].mean():  # light ink on a dark ground: invert
            grey = 1.0 - grey
        out.append(hog(grey, orientations=9, pixels_per_cell=(4, 4), cells_per_block=(2, 2)))
    return np.stack(out)


def svm_on_hog(shards: Path, seed: int) -> tuple[float, float]:
    """(test accuracy, seconds): fitted to the train and val splits, scored on the test split."""
    from sklearn.model_selection import GridSearchCV, StratifiedKFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from sklearn.svm import SVC

    started = time.perf_counter()
    fit = [ShardSplit.open(shards, name) for name in ("train", "val")]
    x = hog_features(np.concatenate([s.all_images() for s in fit]))
    y = np.concatenate([s.labels for s in fit])
    search = GridSearchCV(make_pipeline(StandardScaler(), SVC(kernel="rbf", gamma="scale")),
                          {"svc__C": [1, 10, 100]}, cv=StratifiedKFold(5, shuffle=True, random_state=seed))  # fmt: skip
    search.fit(x, y)
    test = ShardSplit.open(shards, "test")
    accuracy = float((search.predict(hog_features(test.all_images())) == test.labels).mean())
    return accuracy, time.perf_counter() - started


def with_sets(p: Params, sets: list[str]) -> Params:
    """params with `key=value` overrides (dotted keys, values as YAML), validated as params.yaml is."""
    import yaml

    from tasks.core.params import parse_params

    raw = p.model_dump(mode="json")
    for item in sets:
        key, _, value = item.partition("=")
        *parents, leaf = key.split(".")
        node = raw
        for part in parents:
            node = node[part]
        node[leaf] = yaml.safe_load(value)
    return parse_params(raw, source="--set")


def mirror_table(p: Params, tmp: Path) -> None:
    """hflip auto as the train stage resolves it: the mirror check, then on small data where it cannot tell the
    training probe (`--set train.recipe.flip_probe_steps=0`: the check alone)."""
    from tasks.training.start import training_start

    print(f"{'folder':26} {'images':>6} {'chance':>6} {'alone':>6} {'+mirrors':>8} {'mirrored':>8} {'loss':>6} "
          f"{'flips':>5}  decided by: the class the mirrors hurt most (held-out images lost/gained, p), "
          "or the probe (val accuracy with/without flips, lost/gained, p)")  # fmt: skip
    for name in [*MIRROR_FOLDERS, "default data"]:
        if name == "default data":
            shards = ROOT / p.paths.shards
            if not (shards / "manifest.json").is_file():
                print(f"{name:26} skipped: no {p.paths.shards}/manifest.json here (make run first)")
                continue
        else:
            shards = tmp / name.replace(" ", "_") / "shards"
            source = MIRROR_FOLDERS[name](tmp / name.replace(" ", "_") / "images")
            preprocess.run(p.preprocess, seed=p.seed, source=source, out_dir=shards)
        started = time.perf_counter()
        start = training_start(p.train, seed=p.seed, shard_dir=shards, pretrained_dir=ROOT / p.paths.pretrained)
        c, f = start.recipe.mirror, start.recipe.flips
        assert c is not None, "params.yaml's train.augment.hflip must be auto"
        check = f"mirror check: {c.worst_class} {c.worst_lost}/{c.worst_gained}, p {c.worst_p:.2g}"
        if f is not None:
            check += (f"; unsure, probe ({f.steps} steps): val {f.with_flips / f.val_images:.3f} with, "
                      f"{f.without_flips / f.val_images:.3f} without, {f.lost}/{f.gained}, p {f.p:.2g}")  # fmt: skip
        elif not c.decided:
            check += "; unsure, no probe: on"
        print(f"{name:26} {c.images:6d} {c.chance:6.2f} {c.accuracy:6.3f} {c.with_mirrors:8.3f} {c.mirrored:8.3f} "
              f"{c.loss:+6.2f} {'on' if start.params.augment.hflip else 'off':>5}  {check} "
              f"({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folders", nargs="+", default=list(FOLDERS), choices=list(FOLDERS))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a params override")
    parser.add_argument("--mirror", action="store_true", help="only the mirror check's table")
    args = parser.parse_args()
    p = with_sets(load_params(ROOT / "params.yaml"), args.set)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if args.mirror:
            mirror_table(p, tmp)
            return
        rows = []
        for name in args.folders:
            draw, size, test_size = FOLDERS[name]
            source, test = draw(tmp / name / "images", size, 12), draw(tmp / name / "test", test_size, 1000)
            metrics, extra, seconds = pipeline(p, source, tmp / name / "run", {}, test)
            run = extra["run"]
            svm, svm_seconds = svm_on_hog(tmp / name / "run" / "shards", p.seed)
            flips = run["recipe"]["choices"]["augment.hflip"]
            rows.append((name, run["recipe"]["train_images"], metrics["num_samples"], metrics["accuracy"], svm,
                         seconds, svm_seconds, "on" if flips["value"] else "off"))  # fmt: skip
            print(f"{name}: recipe {metrics['accuracy']:.3f}, SVM on HOG {svm:.3f} ({run['recipe']['summary']}; "
                  f"train {seconds:.0f} s; augment.hflip {rows[-1][-1]}: {flips['why']})", flush=True)  # fmt: skip
    print()
    print("overrides:", " ".join(args.set) or "none (params.yaml as it ships)")
    print(f"{'folder':11} {'train':>5} {'test':>5} {'flips':>5} {'recipe':>7} {'SVM+HOG':>7} {'diff':>6} "
          f"{'train s':>7} {'SVM s':>5}")  # fmt: skip
    for name, n_train, n_test, acc, svm, seconds, svm_seconds, flips in rows:
        print(f"{name:11} {n_train:5d} {n_test:5d} {flips:>5} {acc:7.3f} {svm:7.3f} {acc - svm:+6.3f} {seconds:7.0f} "
              f"{svm_seconds:5.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
