"""The fine-tuning recipe against hand-set rates, on near and far data, from two stand-in backbones.

    .venv/bin/python bench/bench_finetune.py                  # every case, about 15 min on 2 cores
    .venv/bin/python bench/bench_finetune.py --cases A-far    # one
    .venv/bin/python bench/bench_finetune.py --probe-only --per-class 5 60   # the probe alone, few-shot and not

Nothing downloads: the backbones are resnet18s trained here. A is the committed run's model (models/model.pt,
the default data); B is trained first on 7 shape kinds, off-centre on cluttered canvases. Each case is a
180-image, 3-class folder drawn by tests/helpers/folders.py (or by the generate stage), 10% of it val, with a
fixed test folder of 300 other drawings (data.test_source): A-near (3 of the default data's classes, new
drawings), A-far (other shapes, off-centre in noise and clutter: the issue's case), B-near (3 other shape kinds,
drawn as B's), B-far (the digits 2, 5, 7, scanned). For each: the linear probe of the start weights' features
(tasks/training/feature_probe.py), then the test and best val accuracy of `train.lr` etc. left at auto and of
three hand-set recipes (every other param as params.yaml ships it): gentle (recipe.finetune_lr_sgd, backbone x0.1),
middle (their geometric mean, backbone x0.3) and strong (the from-scratch rate, backbone at the head's); one
head-only epoch in each.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tasks import evaluate, generate, preprocess, train  # noqa: E402
from tasks.core.io import read_json  # noqa: E402
from tasks.core.params import GenerateParams, Params, load_params  # noqa: E402
from tasks.images.imaging import PreprocessSpec  # noqa: E402
from tasks.images.shards import ShardSplit, load_manifest  # noqa: E402
from tasks.training.feature_probe import feature_probe  # noqa: E402
from tasks.training.models import build_model  # noqa: E402
from tasks.training.pretrained import load_init_weights  # noqa: E402
from tests.helpers.folders import SHAPES, draw_glyph_folder, draw_offcentre_folder  # noqa: E402

CASES = ("A-near", "A-far", "B-near", "B-far")


def pipeline(
    p: Params, source: Path, work: Path, train_update: dict[str, Any], test_source: Path | None = None
) -> tuple[dict, dict, float]:
    shards, reports = work / "shards", work / "reports"
    if not shards.exists():
        preprocess.run(p.preprocess, seed=p.seed, source=source, out_dir=shards, test_source=test_source)
    started = time.perf_counter()
    result = train.run(p.train.model_copy(update=train_update), seed=p.seed, shard_dir=shards,
                       model_path=work / "model.pt", history_path=reports / "h.json", plot_path=reports / "h.png",
                       runs_dir=work / "runs", provenance={}, run_meta_path=reports / "train_run.json")  # fmt: skip
    seconds = time.perf_counter() - started
    evaluate.run(p.evaluate, model_path=result.model_path, shard_dir=shards, metrics_path=reports / "metrics.json",
                 confusion_json=reports / "c.json", confusion_png=reports / "c.png",
                 dynamics_path=reports / "train_dynamics.json")  # fmt: skip
    history = read_json(reports / "h.json")
    return read_json(reports / "metrics.json"), {"val": max(e["val_accuracy"] for e in history),
                                                 "run": read_json(reports / "train_run.json")}, seconds  # fmt: skip


def backbone_b(p: Params, tmp: Path) -> Path:
    other = draw_offcentre_folder(tmp / "b_data", classes=len(SHAPES), per_class=90, seed=11, max_ratio=2.0,
                                  kinds=SHAPES[3:], cluttered=True)  # fmt: skip
    metrics, _, seconds = pipeline(p, other, tmp / "b_model", {})
    print(f"backbone B: 7 shape kinds x 90, test accuracy {metrics['accuracy']:.3f} ({seconds:.0f} s)", flush=True)
    weights = tmp / "backbone_b.pth"
    torch.save(torch.load(tmp / "b_model" / "model.pt", weights_only=True)["state_dict"], weights)
    return weights


def backbone_a(tmp: Path) -> Path:
    weights = tmp / "backbone_a.pth"
    torch.save(torch.load(ROOT / "models" / "model.pt", weights_only=True)["state_dict"], weights)
    return weights


def folder(case: str, out: Path, per_class: int, seed: int) -> Path:
    if case == "A-near":
        generate.run(GenerateParams(num_classes=3, images_per_class=per_class, workers=2), seed=seed, out_dir=out)
        return out
    if case in ("A-far", "B-near"):
        return draw_offcentre_folder(out, classes=3, per_class=per_class, seed=seed, max_ratio=2.0, cluttered=True)
    return draw_glyph_folder(out, per_class=per_class, seed=seed, glyphs="257")


def probe(p: Params, weights: Path, shards: Path) -> str:
    spec = PreprocessSpec.model_validate(load_manifest(shards)["spec"])
    model = build_model(p.train.arch, len(spec.class_names))
    load_init_weights(model, str(weights))
    split = ShardSplit.open(shards, "train")
    result = feature_probe(model, split.all_images(), split.labels, spec, seed=0)
    return result.line()


def probe_table(p: Params, cases: list[str], sizes: list[int]) -> None:
    """The feature probe's `known` and the rates it picks, for each case at each folder size: does it misjudge
    a few-shot folder (about 5 training images per class, the other half of the drawing in val and test)?"""
    from tasks.training.recipe import resolve

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        weights = {"A": backbone_a(tmp)}
        if any(case.startswith("B") for case in cases):
            weights["B"] = backbone_b(p, tmp)
        print(f"{'case':8} {'per class':>9} {'images':>6} {'chance':>6} {'probe':>6} {'known':>6} {'lr':>8} {'bb':>5}")
        for case in cases:
            for per_class in sizes:
                # Twice as many drawn, half of them val and test: about `per_class` per class in the train split.
                source = folder(case, tmp / case / f"images{per_class}", 2 * per_class, 12)
                shards = tmp / case / f"shards{per_class}"
                preprocess.run(p.preprocess.model_copy(update={"val_fraction": 0.25, "test_fraction": 0.25}),
                               seed=p.seed, source=source, out_dir=shards)  # fmt: skip
                spec = PreprocessSpec.model_validate(load_manifest(shards)["spec"])
                model = build_model(p.train.arch, len(spec.class_names))
                load_init_weights(model, str(weights[case[0]]))
                split = ShardSplit.open(shards, "train")
                found = feature_probe(model, split.all_images(), split.labels, spec, seed=0)
                train = p.train.model_copy(
                    update={
                        "init_from": str(weights[case[0]]),
                        "augment": p.train.augment.model_copy(update={"hflip": True}),
                    }
                )
                recipe = resolve(train, len(split.labels), probe=found)
                shown = f"{found.accuracy:6.2f} {found.known:6.2f}" if found.judged else f"{'-':>6} {'-':>6}"
                print(f"{case:8} {per_class:9d} {found.images:6d} {found.chance:6.2f} {shown} "
                      f"{recipe.params.lr:8.4g} {recipe.params.backbone_lr_scale:5.2g}", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--variants", nargs="+", default=["auto", "gentle", "middle", "strong"])
    parser.add_argument("--probe-only", action="store_true", help="only the feature probe, at each --per-class")
    parser.add_argument("--per-class", nargs="+", type=int, default=[60], help="--probe-only: images per class")
    args = parser.parse_args()
    p = load_params(ROOT / "params.yaml")
    if args.probe_only:
        probe_table(p, args.cases, args.per_class)
        return
    r = p.train.recipe
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        weights = {"A": backbone_a(tmp)}
        if any(case.startswith("B") for case in args.cases):
            weights["B"] = backbone_b(p, tmp)
        for case in args.cases:
            source, init = folder(case, tmp / case / "images", 60, 12), str(weights[case[0]])
            # A fixed test folder of 300 other drawings (data.test_source): 18 test images would say little.
            test = folder(case, tmp / case / "test", 100, 1000)
            for variant in args.variants:
                update: dict[str, Any] = {"init_from": init}
                if variant != "auto":
                    batch = 16  # what auto picks for 162 training images; lr scales with it as auto's does
                    gentle, strong = r.finetune_lr_sgd * batch / r.max_batch, r.base_lr_sgd * batch / r.max_batch
                    lr, scale = {"gentle": (gentle, 0.1), "middle": (math.sqrt(gentle * strong), 0.3),
                                 "strong": (strong, 1.0)}[variant]  # fmt: skip
                    update |= {"batch_size": batch, "lr": lr, "backbone_lr_scale": scale, "freeze_epochs": 1}
                metrics, extra, seconds = pipeline(p, source, tmp / case / "runs" / variant, update, test)
                choices = extra["run"]["recipe"]["choices"]
                rows.append((case, variant, metrics["accuracy"], metrics["num_samples"], extra["val"],
                             choices["lr"]["value"], choices["backbone_lr_scale"]["value"], seconds))  # fmt: skip
                print(f"{case} {variant}: test {metrics['accuracy']:.3f} of {metrics['num_samples']}, best val "
                      f"{extra['val']:.3f}, lr {choices['lr']['value']:.4g}, backbone x"
                      f"{choices['backbone_lr_scale']['value']:g}, train {seconds:.0f} s", flush=True)  # fmt: skip
            print(f"{case} probe: {probe(p, Path(init), tmp / case / 'runs' / args.variants[0] / 'shards')}",
                  flush=True)  # fmt: skip
    print()
    print(f"{'case':8} {'variant':8} {'test':>6} {'val':>6} {'lr':>8} {'bb':>5} {'train s':>8}")
    for case, variant, acc, _n, val, lr, scale, seconds in rows:
        print(f"{case:8} {variant:8} {acc:6.3f} {val:6.3f} {lr:8.4g} {scale:5g} {seconds:8.0f}")
    for case in args.cases:
        mine = {v: a for c, v, a, *_ in rows if c == case}
        best = max((a, v) for v, a in mine.items() if v != "auto")
        if "auto" in mine:
            print(f"{case}: auto {mine['auto']:.3f}, best hand-set {best[0]:.3f} ({best[1]}): "
                  f"{mine['auto'] - best[0]:+.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
