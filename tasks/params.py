"""params.yaml -> one typed, frozen `Params` model; every knob of the pipeline lives here.

Each stage reads only its own section (plus `seed` and `paths`), and dvc.yaml declares exactly
those sections as the stage's params, so DVC reruns a stage whenever a value it reads changes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

PARAMS_FILE = Path("params.yaml")


class ParamsError(ValueError):
    """A params file that cannot be used; the message names the file, the key and the value."""


class Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


Fraction = Annotated[float, Field(ge=0.0, lt=1.0)]


class Paths(Section):
    """Every path the pipeline reads or writes, relative to the repository root."""

    generated: Path = Field(Path("data/generated"), description="the embedded default ImageFolder")
    shards: Path = Field(Path("data/shards"), description="Arrow shards + manifest.json")
    model: Path = Field(Path("models/model.pt"), description="trained weights + preprocessing spec")
    onnx: Path = Field(Path("models/model.onnx"), description="exported single-file ONNX model")
    reports: Path = Field(Path("reports"), description="metrics JSON and plot PNGs")
    runs: Path = Field(Path("runs"), description="TensorBoard logs (not versioned)")
    baseline: Path = Field(Path("baseline"), description="promoted baseline metrics (make promote)")


class DataParams(Section):
    source: Path = Field(
        Path("data/generated"),
        description="an ImageFolder (root/<class>/<image>); the default is made by the generate stage",
    )


class GenerateParams(Section):
    num_classes: int = Field(10, ge=2, le=10, description="classes of the procedural dataset")
    images_per_class: int = Field(1000, ge=1)
    min_side: int = Field(32, ge=16, description="smallest image side in pixels")
    max_side: int = Field(256, ge=16, description="largest image side in pixels")
    grayscale_fraction: Fraction = 0.2
    png_fraction: Fraction = 0.5
    workers: int = Field(2, ge=1)

    @model_validator(mode="after")
    def _sides(self) -> GenerateParams:
        if self.min_side > self.max_side:
            raise ValueError(f"min_side ({self.min_side}) is larger than max_side ({self.max_side})")
        return self


class PreprocessParams(Section):
    image_size: int = Field(64, ge=16, le=1024, description="side of the square model input")
    interpolation: Literal["bilinear", "bicubic", "nearest"] = "bilinear"
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    val_fraction: Fraction = 0.1
    test_fraction: Fraction = 0.1
    shard_size: int = Field(4096, ge=1, description="images per shard file")
    workers: int = Field(2, ge=1)

    @model_validator(mode="after")
    def _fractions(self) -> PreprocessParams:
        if self.val_fraction + self.test_fraction >= 1.0:
            raise ValueError("val_fraction + test_fraction must leave images for training")
        if min(self.std) <= 0:
            raise ValueError(f"std must be positive, got {self.std}")
        return self


class AugmentParams(Section):
    hflip: bool = True
    crop_padding: int = Field(4, ge=0, description="pad-and-random-crop, in pixels")


class TrainParams(Section):
    arch: Literal["resnet18", "resnet34", "resnet50", "mobilenet_v3_small"] = "resnet18"
    epochs: int = Field(6, ge=1)
    batch_size: int = Field(64, ge=1)
    optimizer: Literal["sgd", "adamw"] = "sgd"
    lr: float = Field(0.1, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(5e-4, ge=0)
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    warmup_epochs: float = Field(0.5, ge=0, description="linear warmup before the cosine decay")
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    num_workers: int = Field(0, ge=0)
    threads: int = Field(0, ge=0, description="torch intra-op threads; 0 = all cores")
    augment: AugmentParams = AugmentParams()


class EvaluateParams(Section):
    batch_size: int = Field(256, ge=1)


class ExportParams(Section):
    opset: int = Field(18, ge=13)
    min_agreement: float = Field(1.0, ge=0, le=1, description="top-1 agreement ONNX vs PyTorch")
    max_abs_diff: float = Field(1e-3, gt=0, description="largest |logit difference| allowed")
    batch_size: int = Field(256, ge=1)


class Rule(Section):
    metric: str = Field(description="dotted key into metrics.json, e.g. accuracy")
    direction: Literal["higher", "lower"] = "higher"
    abs_tol: float = Field(0.0, ge=0, description="allowed worsening, absolute")
    rel_tol: float = Field(0.0, ge=0, description="allowed worsening, relative to the baseline")


class RegressionParams(Section):
    rules: tuple[Rule, ...] = (
        Rule(metric="accuracy", abs_tol=0.02),
        Rule(metric="macro_f1", abs_tol=0.02),
    )


class Params(Section):
    seed: int = Field(42, ge=0, description="the one seed every other seed derives from")
    paths: Paths = Paths()
    data: DataParams = DataParams()
    generate: GenerateParams = GenerateParams()
    preprocess: PreprocessParams = PreprocessParams()
    train: TrainParams = TrainParams()
    evaluate: EvaluateParams = EvaluateParams()
    export: ExportParams = ExportParams()
    regression: RegressionParams = RegressionParams()


def _describe(error: dict) -> str:
    key = ".".join(str(part) for part in error["loc"]) or "<top level>"
    if error["type"] == "extra_forbidden":
        return f"{key}: unknown key"
    return f"{key}: {error['msg']} (got {error.get('input')!r})"


def parse_params(raw: object, source: str = "params.yaml") -> Params:
    try:
        return Params.model_validate(raw if raw is not None else {})
    except ValidationError as exc:
        lines = "\n  ".join(_describe(err) for err in exc.errors())
        raise ParamsError(f"{source}: invalid params\n  {lines}") from None


def load_params(path: Path = PARAMS_FILE) -> Params:
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ParamsError(f"{path}: file not found") from None
    except yaml.YAMLError as exc:
        raise ParamsError(f"{path}: not valid YAML: {exc}") from None
    return parse_params(raw, str(path))


def derive_seed(seed: int, *names: object) -> int:
    """A 63-bit seed for one purpose (stage, epoch, sample), derived from the root seed."""
    digest = hashlib.sha256(json.dumps([seed, *map(str, names)]).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def section_hash(section: BaseModel) -> str:
    """A stable hash of a params section, recorded with the artifacts made from it."""
    return hashlib.sha256(section.model_dump_json().encode()).hexdigest()
