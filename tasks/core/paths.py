"""Every path the pipeline reads or writes (params.yaml `paths`), and the name of every report file.

A report's name is written here once; stages, flows, serving and tests ask `Paths` for it. dvc.yaml
declares the same files (tests/test_contract.py checks that the two agree).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

# The promoted baseline's files, inside `baseline` (functions that take the folder join these).
BASELINE_METRICS = "metrics.json"  # the promoted model's test metrics
BASELINE_MODEL = "model.json"  # the promoted model's hashes and provenance
BASELINE_ONNX = "model.onnx"  # the promoted model itself
BASELINE_WEIGHTS = "model.pt"  # the PyTorch model it was exported from: what train.warm_start grows from
BASELINE_DECISION = "decision.json"  # who promoted it, when, why, and the gate verdict a person set aside


class Paths(BaseModel):
    """Every path the pipeline reads or writes, relative to the repository root."""

    generated: Path = Field(Path("data/generated"), description="the embedded default ImageFolder")
    shards: Path = Field(Path("data/shards"), description="Arrow shards + manifest.json")
    model: Path = Field(Path("models/model.pt"), description="trained weights + preprocessing spec")
    onnx: Path = Field(Path("models/model.onnx"), description="exported single-file ONNX model")
    exports: Path = Field(
        Path("models/exports"), description="the other formats export.formats asks for (INT8 ONNX, TorchScript)"
    )
    reports: Path = Field(Path("reports"), description="metrics JSON and plot PNGs")
    runs: Path = Field(Path("runs"), description="TensorBoard logs (not versioned)")
    checkpoints: Path = Field(
        Path("runs/checkpoints"), description="training checkpoints, a folder per run (not versioned, kept by repro)"
    )
    baseline: Path = Field(Path("baseline"), description="promoted baseline metrics (make promote)")
    pretrained: Path = Field(
        Path("models/pretrained"), description="torchvision's published weights files, DVC-tracked (make add-weights)"
    )

    parent: Path = Field(
        Path("models/parent"),
        description="the production model's weights for train.warm_start, DVC-tracked (make warm-start)",
    )

    model_config = ConfigDict(frozen=True, extra="forbid")

    # -- reports (under `reports`) ---------------------------------------------------------------
    @property
    def train_history(self) -> Path:
        return self.reports / "train_history.json"  # one row per epoch (dvc plots)

    @property
    def train_curves(self) -> Path:
        return self.reports / "train_curves.png"

    @property
    def train_batch_png(self) -> Path:
        return self.reports / "train_batch.png"  # the first training batch as the model gets it (augmented)

    @property
    def val_batch_png(self) -> Path:
        return self.reports / "val_batch.png"  # validation images as the model gets them (no augmentation)

    @property
    def train_run(self) -> Path:
        return self.reports / "train_run.json"  # what the run did: recipe, precision, steps, coverage

    @property
    def train_dynamics(self) -> Path:
        return self.reports / "train_dynamics.json"  # per training image: its area under the margin (label errors)

    @property
    def metrics(self) -> Path:
        return self.reports / "metrics.json"  # evaluate: test metrics (dvc metrics)

    @property
    def confusion_json(self) -> Path:
        return self.reports / "confusion.json"

    @property
    def confusion_png(self) -> Path:
        return self.reports / "confusion.png"

    @property
    def errors_gallery(self) -> Path:
        return self.reports / "errors_gallery.png"  # evaluate: the test images with the highest loss

    @property
    def per_class_png(self) -> Path:
        return self.reports / "per_class.png"  # evaluate: precision and recall per class

    @property
    def label_errors(self) -> Path:
        return self.reports / "label_errors.json"  # evaluate: likely label errors over every accepted image

    @property
    def export_report(self) -> Path:
        return self.reports / "export.json"  # export: checks, hashes (onnx_sha256) of the files it proved

    @property
    def export_timings(self) -> Path:
        return self.reports / "export_timings.json"  # latency, not declared in dvc.yaml (it differs every run)

    @property
    def regression_json(self) -> Path:
        return self.reports / "regression.json"  # check_regression: the verdict, rule by rule

    @property
    def regression_md(self) -> Path:
        return self.reports / "regression.md"

    @property
    def environment(self) -> Path:
        return self.reports / "environment"  # environment: one <stage>.json per stage, each a dep of its stage

    def environment_record(self, stage: str) -> Path:
        """The environment stage's record of the machine and libraries `stage` runs with (a dep of `stage`)."""
        return self.environment / f"{stage}.json"

    @property
    def gate(self) -> Path:
        return self.reports / "gate.json"  # the verdict's status as a dvc metric

    @property
    def run_manifest(self) -> Path:
        return self.reports / "run_manifest.json"  # train-flow: what each stage did in this run

    @property
    def inspect_report(self) -> Path:
        return self.reports / "inspect.json"  # make inspect: the layer trace (not versioned)

    @property
    def lr_find_json(self) -> Path:
        return self.reports / "lr_find.json"  # make lr-find: the learning-rate range test (not versioned)

    @property
    def lr_find_png(self) -> Path:
        return self.reports / "lr_find.png"

    @property
    def sanity_report(self) -> Path:
        return self.runs / "sanity.json"

    # -- the promoted baseline (under `baseline`, make promote) -------------------------------------
    @property
    def baseline_metrics(self) -> Path:
        return self.baseline / BASELINE_METRICS

    @property
    def baseline_model_record(self) -> Path:
        return self.baseline / BASELINE_MODEL

    @property
    def baseline_onnx(self) -> Path:
        return self.baseline / BASELINE_ONNX

    @property
    def baseline_weights(self) -> Path:
        return self.baseline / BASELINE_WEIGHTS
