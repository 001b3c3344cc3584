"""evaluate on a tiny trained model (train: tests/stages/test_train.py; export: tests/stages/test_export.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from tasks import evaluate, preprocess, train
from tasks.core.io import read_json
from tasks.core.params import Params
from tasks.images.shards import ShardSplit
from tasks.tools import review_label_errors
from tasks.training.models import load_model_file, split_logits
from tasks.training.tempered import temperature_of
from tests.helpers.project import TINY

PARAMS = Params.model_validate(TINY | {"train": {**TINY["train"], "epochs": 2}})


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.helpers.folders import make_imagefolder

    root = tmp_path_factory.mktemp("stages")
    make_imagefolder(root / "images", classes=3, per_class=24)
    preprocess.run(PARAMS.preprocess, seed=PARAMS.seed, source=root / "images", out_dir=root / "shards")
    return root / "shards"


def train_once(shards: Path, out: Path, **update: object) -> Path:
    params = PARAMS.train.model_copy(update=update)
    train.run(
        params, seed=PARAMS.seed, shard_dir=shards, model_path=out / "model.pt",
        history_path=out / "history.json", plot_path=out / "history.png", runs_dir=out / "runs",
        provenance={"params_sha256": "x"},
    )  # fmt: skip
    return out / "model.pt"


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def model(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_once(shards, tmp_path_factory.mktemp("model"))


# The train stage's own tests (determinism, history, resume, faults): tests/stages/test_train.py, tests/training/.


def test_evaluate_writes_metrics_and_confusion(shards: Path, model: Path, tmp_path: Path) -> None:
    result = evaluate.run(
        PARAMS.evaluate, model_path=model, shard_dir=shards, metrics_path=tmp_path / "m.json",
        confusion_json=tmp_path / "c.json", confusion_png=tmp_path / "c.png",
        dynamics_path=model.parent / "train_dynamics.json",
    )  # fmt: skip
    metrics = read_json(tmp_path / "m.json")
    assert metrics["accuracy"] == result.accuracy and set(metrics["per_class"]) == {"class_0", "class_1", "class_2"}
    assert len(read_json(tmp_path / "c.json")) == metrics["num_samples"] == result.num_samples
    assert sum(c["support"] for c in metrics["per_class"].values()) == metrics["num_samples"]
    for name in ("per_class.png", "errors_gallery.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG", name
    errors = read_json(tmp_path / "label_errors.json")
    manifest = read_json(shards / "manifest.json")
    assert errors["images_scored"] == len(manifest["files"]) == 72  # every accepted image, every split
    ranked = errors["likely_label_errors"]
    assert len(ranked) == min(PARAMS.evaluate.label_errors, 72) and [e["rank"] for e in ranked] == list(range(1, 73))
    assert [e["score"] for e in ranked] == sorted(e["score"] for e in ranked)  # lowest margin first
    assert {e["split"] for e in ranked} == {"train", "val", "test"}
    # Out of sample: a training image by its area under the margin, held-out ones by the final model.
    dynamics = read_json(model.parent / "train_dynamics.json")
    assert len(dynamics["aum"]) == len(dynamics["times_trained"]) == manifest["splits"]["train"]["count"]
    assert max(dynamics["times_trained"]) == PARAMS.train.epochs  # whole batches: a few images no step drew
    for entry in ranked:
        index = next(f["index"] for f in manifest["files"] if f["sha256"] == entry["sha256"])
        during = entry["split"] == "train" and dynamics["times_trained"][index] > 0
        assert entry["scored_by"] == ("area under the margin during training" if during else "final model, held out")
        if during:
            assert entry["score"] == dynamics["aum"][index]
        assert entry["suggested"] != entry["given"]
    # The served scale: the final model's probabilities with model.pt's temperature, as an upload's on the page.
    loaded, spec, payload = load_model_file(model)
    temperature = temperature_of(payload)
    assert errors["temperature"] == temperature
    served = {}
    for entry in ranked:
        if entry["scored_by"] != "final model, held out":
            continue
        if entry["split"] not in served:
            served[entry["split"]] = split_logits(loaded, ShardSplit.open(shards, entry["split"]), spec)
        index = next(f["index"] for f in manifest["files"] if f["sha256"] == entry["sha256"])
        row = served[entry["split"]][index] / temperature
        probs = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
        assert entry["p_predicted"] == pytest.approx(float(probs.max()), abs=2e-4), entry


def test_planted_label_errors_top_the_ranking(tmp_path: Path) -> None:
    """10 images moved into a wrong class folder: at least 7 of them in the top 30 of label_errors.json."""
    from tests.helpers.folders import make_imagefolder

    images = make_imagefolder(tmp_path / "images", classes=3, per_class=40, seed=4)
    planted = []
    for k, path in enumerate(sorted((images / "class_0").iterdir())[:10]):
        target = images / f"class_{1 + k % 2}" / f"planted_{k}{path.suffix}"
        path.rename(target)
        planted.append(str(target))
    preprocess.run(PARAMS.preprocess, seed=PARAMS.seed, source=images, out_dir=tmp_path / "shards")
    model = train_once(tmp_path / "shards", tmp_path / "model", epochs=3)
    evaluate.run(
        PARAMS.evaluate.model_copy(update={"label_errors": 30}), model_path=model, shard_dir=tmp_path / "shards",
        metrics_path=tmp_path / "reports" / "metrics.json", confusion_json=tmp_path / "reports" / "c.json",
        confusion_png=tmp_path / "reports" / "c.png", dynamics_path=tmp_path / "model" / "train_dynamics.json",
        roots={"source": str(images)},
    )  # fmt: skip
    top = read_json(tmp_path / "reports" / "label_errors.json")["likely_label_errors"]
    assert all(Path(entry["file"]).is_file() for entry in top)  # the files a user opens to fix them
    found = [entry for entry in top if entry["file"] in planted]
    print(f"{len(found)} of 10 planted label errors in the top 30; ranks {[e['rank'] for e in found]}")
    assert len(found) >= 7
    assert all(entry["suggested"] == "class_0" for entry in found[:7])  # the class they really are
    # Into the review folder, the server's layout: <predicted class>/<sha256>.<ext> + sidecar; twice is once.
    copied = review_label_errors.run(tmp_path / "reports" / "label_errors.json", tmp_path / "review", top=10)
    assert len(copied) == 10 and review_label_errors.run(tmp_path / "reports" / "label_errors.json",
                                                         tmp_path / "review", top=10) == []  # fmt: skip
    first = copied[0]
    assert first.parent.name == top[0]["suggested"] and first.read_bytes() == Path(top[0]["file"]).read_bytes()
    assert read_json(first.with_suffix(".json"))["file"] == top[0]["file"]


# The export stage's tests are in tests/stages/test_export.py (and the gate's in tests/stages/test_check_regression.py).
