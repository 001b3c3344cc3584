"""A model trained and exported once on tiny colour-coded shards, for the export, inference and gate tests."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tasks import check_regression, export, preprocess, train
from tasks.core.params import ExportParams, Params
from tasks.release.verdict import Verdict
from tasks.tools import promote
from tests.helpers.folders import make_imagefolder
from tests.helpers.project import TINY, deep_update

# The INT8 gates at their defaults (TINY loosens them for an untrained pipeline model).
# Six epochs: two (6 steps) learned the colour classes in bf16 but not in fp32, a coin flip; four did in bf16, but
# not in fp32 once JPEGs were decoded at their DCT scale (the INT8 gates then refused a model at 0.73 accuracy).
PARAMS = Params.model_validate(
    deep_update(
        TINY,
        {
            "train": {"epochs": 6},
            "export": {"formats": list(ExportParams().formats), "int8": ExportParams().int8.model_dump()},
        },
    )
)


def make_shards(root: Path, classes: int = 3, per_class: int = 30) -> Path:
    make_imagefolder(root / "images", classes=classes, per_class=per_class)
    preprocess.run(PARAMS.preprocess, seed=PARAMS.seed, source=root / "images", out_dir=root / "shards")
    return root / "shards"


def train_model(shards: Path, out: Path) -> Path:
    train.run(
        PARAMS.train, seed=PARAMS.seed, shard_dir=shards, model_path=out / "model.pt",
        history_path=out / "history.json", plot_path=out / "history.png", runs_dir=out / "runs",
        provenance={"params_sha256": "p" * 64, "data_manifest_sha256": "d" * 64},
    )  # fmt: skip
    return out / "model.pt"


def export_model(shards: Path, model: Path, out: Path, params: ExportParams = PARAMS.export) -> export.ExportResult:
    """The stage's run() with the project layout under `out` (models/, reports/)."""
    return export.run(
        params, seed=PARAMS.seed, model_path=model, shard_dir=shards, onnx_path=out / "models" / "model.onnx",
        exports_dir=out / "models" / "exports", report_path=out / "reports" / "export.json",
        timings_path=out / "reports" / "export_timings.json",
    )  # fmt: skip


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


ONNX_ONLY = PARAMS.export.model_copy(
    update={"formats": ("onnx",), "timing": PARAMS.export.timing.model_copy(update={"repeats": 1, "batch_sizes": (1,)})}
)


def check(
    project: Path, shards: Path, baseline_dir: Path, out: Path | None = None, cache: Path | None = None
) -> Verdict:
    """check_regression's run() with the project layout; with `cache`, the scores kept there as _main keeps them."""
    out = out or project
    return check_regression.run(
        PARAMS.regression, onnx_path=project / "models/model.onnx", export_report=project / "reports/export.json",
        shard_dir=shards, baseline_dir=baseline_dir, verdict_path=out / "reports/regression.json",
        table_path=out / "reports/regression.md", gate_path=out / "reports/gate.json",
        scores_path=cache / "scores.json" if cache else None,
        baseline_scores_path=cache / "baseline_scores.json" if cache else None,
    )  # fmt: skip


def promote_to(project: Path, model: Path, shards: Path, baseline_dir: Path) -> promote.PromoteResult:
    return promote.run(
        onnx_path=project / "models/model.onnx", model_path=model, export_report=project / "reports/export.json",
        verdict_path=project / "reports/regression.json", shard_dir=shards, baseline_dir=baseline_dir,
        track_with_dvc=False,
    )  # fmt: skip
