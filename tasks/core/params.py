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
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from tasks.core.experiment_params import SweepParams, TrackingParams
from tasks.core.param_errors import describe_errors
from tasks.core.paths import Paths

PARAMS_FILE = Path("params.yaml")


class ParamsError(ValueError):
    """A params file that cannot be used; the message names the file, the key and the value."""


class Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


Fraction = Annotated[float, Field(ge=0.0, lt=1.0)]
AUTO = "auto"
TIMM_PREFIX = "timm/"  # train.arch timm/<name>: timm.create_model(<name>); otherwise a torchvision model's name
ARCH_NAME = r"^(timm/)?[a-z][a-z0-9_.]*$"  # the spelling; tasks/training/models.py checks the name is a model
Arch = Annotated[
    str,
    Field(
        pattern=ARCH_NAME,
        description="a torchvision classification model by name (resnet18, efficientnet_b0, convnext_tiny, ...) or a "
        "timm model as timm/<name> (timm/mobilenetv4_conv_small, ...)",
    ),
]
Auto = Literal["auto"]  # chosen from the data at run time (tasks/training/recipe.py); a number is used as written


class DataParams(Section):
    source: Path = Field(
        Path("data/generated"),
        description="an ImageFolder (root/<class>/<image>); the default is made by the generate stage",
    )
    test_source: Path = Field(
        Path("data/generated"),
        description="a fixed test ImageFolder, all of it the test split; equal to paths.generated means none "
        "(DVC cannot track a null path, and paths.generated always exists)",
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
    resize: Literal["auto", "crop", "squash", "pad"] = Field(
        "auto",
        description="how an image becomes the square (fastai's names): crop = shorter side, then the centre; "
        "squash = both sides, aspect not kept; pad = longer side, black bars; auto = chosen from the aspect ratios",
    )
    interpolation: Literal["bilinear", "bicubic", "nearest"] = "bilinear"
    decode: Literal["dct_scaled", "full"] = Field(
        "dct_scaled",
        description="dct_scaled: a JPEG is decoded at the smallest DCT scale (1/2, 1/4, 1/8) whose sides still "
        "cover image_size, then resized as in full; full: every pixel decoded. Recorded in the model's spec, so "
        "serving decodes alike",
    )
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    val_fraction: Fraction = 0.1
    test_fraction: Fraction = 0.1
    shard_size: int = Field(
        4096,
        ge=1,
        description="images per shard file, on average: boundaries fall on content hashes, so adding "
        "or removing an image rewrites only the shard that holds it",
    )
    workers: int = Field(2, ge=1, description="decoder processes")
    decode_timeout_s: float = Field(
        120,
        gt=0,
        description="the longest a decoder may take over one chunk of files (then each file alone) "
        "before it is killed and the file quarantined as worker_crash: a hung decoder costs one file, not the run",
    )
    min_side: int = Field(16, ge=1, description="images with a shorter side below this are quarantined (too_small)")
    max_pixels: int = Field(
        89_478_485,
        ge=1,
        description="images whose header declares more pixels are quarantined before decoding (decompression_bomb)",
    )

    @model_validator(mode="after")
    def _fractions(self) -> PreprocessParams:
        if self.val_fraction + self.test_fraction >= 1.0:
            raise ValueError("val_fraction + test_fraction must leave images for training")
        if min(self.std) <= 0:
            raise ValueError(f"std must be positive, got {self.std}")
        return self


class ColorJitterParams(Section):
    """Per-sample colour factors drawn uniformly from [max(0, 1 - x), 1 + x]; 0 leaves that property alone."""

    brightness: float = Field(0.0, ge=0, description="pixel values x a factor")
    contrast: float = Field(0.0, ge=0, description="blend with the image's mean grey level")
    saturation: float = Field(0.0, ge=0, description="blend with the pixel's grey level")

    @property
    def enabled(self) -> bool:
        return bool(self.brightness or self.contrast or self.saturation)


class AugmentParams(Section):
    hflip: bool | Literal["auto"] = Field(
        AUTO,
        description="flip horizontally with probability 0.5; auto: when a check of the training images finds that a "
        "mirror image keeps its class (photos: yes; glyphs, digits, text: no)",
    )
    crop: Literal["pad", "random_resized", "none"] = Field(
        "pad", description="pad: reflect-pad then crop at a random offset; random_resized: random area and ratio"
    )
    crop_padding: int = Field(4, ge=0, description="crop: pad - padding in pixels")
    scale: tuple[float, float] = Field(
        (0.25, 1.0), description="crop: random_resized - the crop's area as a fraction of the image, min and max"
    )
    ratio: tuple[float, float] = Field(
        (0.75, 1.3333333), description="crop: random_resized - the crop's aspect ratio (width / height), min and max"
    )
    color_jitter: ColorJitterParams = ColorJitterParams()
    policy: Literal["none", "rand_augment", "trivial_augment"] = Field(
        "none", description="torchvision's RandAugment or TrivialAugmentWide after the crop and flip, seeded per sample"
    )
    policy_ops: int = Field(2, ge=1, le=10, description="rand_augment: operations per image")
    policy_magnitude: int = Field(9, ge=0, le=30, description="rand_augment: strength of each operation, 0-30")

    @model_validator(mode="after")
    def _ranges(self) -> AugmentParams:
        if not 0 < self.scale[0] <= self.scale[1] <= 1:
            raise ValueError(f"scale must satisfy 0 < min <= max <= 1, got {list(self.scale)}")
        if not 0 < self.ratio[0] <= self.ratio[1]:
            raise ValueError(f"ratio must satisfy 0 < min <= max, got {list(self.ratio)}")
        return self


class WarmStartParams(Section):
    """Start from the production model's weights (paths.parent, put there by `make warm-start`), shrunk and perturbed
    (Ash & Adams 2020): every parameter becomes shrink x parent + perturb x this run's fresh initialisation."""

    enabled: bool = Field(False, description="start from paths.parent/model.pt (make warm-start); false: from scratch")
    shrink: float = Field(0.5, gt=0, le=1, description="the parent's weights times this (1: a plain warm start)")
    perturb: float = Field(0.1, ge=0, le=1, description="plus this times the run's fresh initialisation (0: none)")


class RecipeParams(Section):
    """What `auto` means for train.batch_size, lr, epochs and warmup_epochs (tasks/training/recipe.py)."""

    min_steps: int = Field(400, ge=1, description="epochs: auto trains at least this many optimizer steps")
    min_epochs: int = Field(6, ge=1, description="epochs: auto trains at least this many epochs")
    max_batch: int = Field(64, ge=1, description="batch_size: auto is at most this (and the reference of base_lr)")
    min_batch: int = Field(8, ge=1, description="batch_size: auto is at least this (BatchNorm), the split permitting")
    min_steps_per_epoch: int = Field(8, ge=1, description="batch_size: auto leaves an epoch at least this many steps")
    base_lr_sgd: float = Field(0.1, gt=0, description="lr: auto = this x batch_size / max_batch, for sgd")
    base_lr_adamw: float = Field(0.001, gt=0, description="lr: auto = this x batch_size / max_batch, for adamw")
    warmup_fraction: float = Field(0.0833, ge=0, lt=1, description="warmup_epochs: auto = epochs x this")
    # Starting from weights (train.pretrained or init_from), `auto` means fine-tuning, the seed's order:
    # the head alone first, then every layer at a small rate, the backbone's smaller still.
    finetune_lr_sgd: float = Field(0.03, gt=0, description="from weights, lr: auto = this x batch_size / max_batch")
    finetune_lr_adamw: float = Field(0.0005, gt=0, description="from weights, the same for adamw")
    finetune_backbone_lr_scale: float = Field(
        0.3, gt=0, description="from weights, backbone_lr_scale: auto = this (from scratch: 1)"
    )
    finetune_freeze_epochs: int = Field(
        1, ge=0, description="from weights, freeze_epochs: auto = this many head-only epochs (from scratch: 0)"
    )
    # How far the new data is from the weights: a linear probe of the start features (feature_probe.py) says
    # how much of the new classes they already know. At or above `finetune_near_known` the rates above hold;
    # at or below `finetune_far_known`, the from-scratch rate with the backbone at the head's (the features
    # must be relearnt); in between, both rates move geometrically from one to the other.
    finetune_near_known: Fraction = Field(0.9, description="from weights: probe's known share at which data is near")
    finetune_far_known: Fraction = Field(0.5, description="from weights: probe's known share at which data is far")
    # A small train split (fewer images than `small_data_images`) from scratch trains longer: of the candidates
    # bench/bench_small_data.py measured against an SVM on HOG features, only a longer schedule helped.
    small_data_images: int = Field(2000, ge=0, description="a train split below this many images is small")
    small_min_steps: int = Field(1000, ge=1, description="small data: epochs auto trains at least this many steps")
    ema_span: float = Field(0.1, gt=0, le=1, description="ema_decay auto = 1 - 1 / (this x the run's steps)")
    # A long-tailed train split (largest / smallest class at least `imbalance_ratio`) gets `imbalance_remedy`
    # under train.imbalance auto: the candidate bench/bench_long_tail.py measured best against an SVM on HOG
    # features with balanced class weights.
    imbalance_ratio: float = Field(4.0, ge=1, description="imbalance auto: this largest/smallest ratio is long-tailed")
    imbalance_remedy: Literal["class_balanced", "logit_adjust", "balanced_sampler"] = Field(
        "logit_adjust", description="imbalance auto: the remedy a long-tailed split gets"
    )
    cb_beta: float = Field(
        0.999, gt=0, lt=1, description="class_balanced: weights 1 / effective number (1 - beta^n) / (1 - beta)"
    )
    # Small data where the mirror check cannot tell (tasks/training/mirror.py): a short paired training probe on
    # the validation split decides augment.hflip auto.
    flip_probe_steps: int = Field(
        300, ge=0, description="hflip auto, small data, mirror check undecided: steps per probe arm (0: no probe)"
    )

    @model_validator(mode="after")
    def _batches(self) -> RecipeParams:
        if self.min_batch > self.max_batch:
            raise ValueError(f"min_batch ({self.min_batch}) is larger than max_batch ({self.max_batch})")
        if self.finetune_far_known >= self.finetune_near_known:
            raise ValueError(f"finetune_far_known ({self.finetune_far_known}) must be below finetune_near_known "
                             f"({self.finetune_near_known})")  # fmt: skip
        return self


class TrainParams(Section):
    """The train stage. batch_size is the global batch of one optimizer step, whatever the number of
    processes and accumulation steps: per-process micro-batch = batch_size / (processes x accumulation)."""

    arch: Arch = "resnet18"
    epochs: Annotated[int, Field(ge=1)] | Auto = Field("auto", description="auto: see recipe")
    batch_size: Annotated[int, Field(ge=1)] | Auto = Field("auto", description="global batch per optimizer step")
    accumulation_steps: int = Field(1, ge=1, description="micro-batches per optimizer step and process")
    optimizer: Literal["sgd", "adamw"] = "sgd"
    lr: Annotated[float, Field(gt=0)] | Auto = Field(
        "auto", description="learning rate of the head; the backbone's is lr x backbone_lr_scale"
    )
    backbone_lr_scale: Annotated[float, Field(gt=0)] | Auto = Field(
        "auto", description="backbone lr relative to the head's; auto: 1 from scratch, recipe's when from weights"
    )
    freeze_epochs: Annotated[int, Field(ge=0)] | Auto = Field(
        "auto", description="epochs that train the head alone before every layer trains; auto: see recipe"
    )
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum (Nesterov when > 0)")
    weight_decay: float = Field(5e-4, ge=0)
    decay_norm_and_bias: bool = Field(
        True, description="also decay BatchNorm weights and all biases (false: only conv and linear weights)"
    )
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    imbalance: Literal["auto", "none", "class_balanced", "logit_adjust", "balanced_sampler"] = Field(
        "auto",
        description="long-tailed train split: class_balanced loss weights (Cui et al. 2019), logit adjustment by "
        "the class prior (Menon et al. 2021) or a class-balanced sampler; auto: recipe.imbalance_remedy when the "
        "largest/smallest class ratio reaches recipe.imbalance_ratio, else none",
    )
    calibrate: bool = Field(
        True,
        description="fit one temperature on the validation split by NLL, kept when it lowers it; export folds it "
        "into the ONNX, so served probabilities are calibrated",
    )
    clip_grad_norm: float = Field(0.0, ge=0, description="max global norm of the unscaled gradients; 0 = off")
    ema: bool = Field(
        False, description="validate and keep an exponential moving average of the weights (torch's AveragedModel)"
    )
    ema_decay: Annotated[float, Field(gt=0, lt=1)] | Auto = Field(
        AUTO, description="ema: the average's decay per optimizer step; auto: it spans recipe.ema_span of the run"
    )
    scheduler: Literal["cosine", "step", "plateau"] = Field("cosine", description="lr schedule after the warmup")
    warmup_epochs: Annotated[float, Field(ge=0)] | Auto = Field("auto", description="linear warmup before the schedule")
    step_epochs: float = Field(2.0, gt=0, description="step: lr x gamma every step_epochs")
    gamma: float = Field(0.1, gt=0, lt=1, description="lr factor of the step and plateau schedulers")
    plateau_patience: int = Field(1, ge=0, description="plateau: epochs without improvement before lowering lr")
    monitor: Literal["val_accuracy", "val_loss"] = Field(
        "val_accuracy", description="validation metric that picks best.pt and drives the plateau scheduler"
    )
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="auto: bf16 on CPUs with native bf16, else fp32; on CUDA bf16, or fp16 + GradScaler"
    )
    memory_format: Literal["auto", "contiguous", "channels_last"] = Field(
        "auto", description="auto: the format measured faster for the device and precision (docs/training.md)"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when available")
    compile: bool = Field(False, description="torch.compile the model (checkpoints load either way)")
    pretrained: str | None = Field(
        None,
        description="published weights of arch to start from: torchvision's (IMAGENET1K_V1, DEFAULT, ...) or timm's "
        "pretrained tag (e2400_r224_in1k, DEFAULT, ...), a DVC-tracked file in paths.pretrained (make add-weights)",
    )
    init_from: Path | None = Field(None, description="local weights to start from; mismatched layers are skipped")
    warm_start: WarmStartParams = WarmStartParams()
    freeze_backbone: bool = Field(False, description="train the head only; frozen BatchNorm stays in eval mode")
    nproc_per_node: int = Field(1, ge=1, description="> 1: DDP processes under torchrun --standalone")
    nnodes: int = Field(
        1, ge=1, description="> 1: one torchrun per node; the head runs `dvc repro train`, the others `make train-join`"
    )
    rdzv_endpoint: str = Field(
        "127.0.0.1:29400", description="nnodes > 1: host:port of the head node, where torchrun's c10d rendezvous meets"
    )
    rdzv_timeout_s: int = Field(600, ge=1, description="nnodes > 1: how long the nodes wait for each other to join")
    auto_batch: bool = Field(False, description="on CUDA OOM: halve the micro-batch, double accumulation")
    nonfinite: Literal["skip", "abort"] = Field("skip", description="a step with a NaN/Inf loss or gradient")
    max_nonfinite: int = Field(10, ge=0, description="skip: stop the run after more than this many such steps")
    checkpoint_every_steps: int = Field(250, ge=0, description="also checkpoint every N steps; 0 = epoch ends only")
    resume: bool = Field(True, description="continue from this run's last checkpoint; false = start fresh")
    keep_checkpoint_runs: int = Field(
        3, ge=0, description="after a finished run, keep the checkpoints of this many most recent runs (0 = all)"
    )
    histogram_every_steps: int = Field(250, ge=0, description="TensorBoard weight/gradient histograms; 0 = off")
    num_workers: int = Field(0, ge=0)
    threads: int = Field(0, ge=0, description="torch intra-op threads; 0 = all cores (shared between processes)")
    augment: AugmentParams = AugmentParams()
    recipe: RecipeParams = RecipeParams()

    @field_validator("init_from")
    @classmethod
    def _one_start(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        pretrained = info.data.get("pretrained")
        if value is not None and pretrained is not None:
            raise ValueError(f"train.pretrained ({pretrained}) is set too: the model starts from one; leave one empty")
        return value

    @model_validator(mode="after")
    def _one_start_of_three(self) -> TrainParams:
        other = "train.pretrained" if self.pretrained is not None else "train.init_from" if self.init_from else None
        if self.warm_start.enabled and other:
            raise ValueError(f"train.warm_start.enabled and {other} are both set: the model starts from one; "
                             "leave one off")  # fmt: skip
        return self

    @property
    def from_weights(self) -> bool:
        return self.pretrained is not None or self.init_from is not None

    @model_validator(mode="after")
    def _batch_splits(self) -> TrainParams:
        parts = self.nnodes * self.nproc_per_node * self.accumulation_steps
        if self.batch_size != AUTO and self.batch_size % parts:
            nodes = f"nnodes ({self.nnodes}) x " if self.nnodes > 1 else ""
            raise ValueError(
                f"batch_size ({self.batch_size}) must be divisible by {nodes}nproc_per_node ({self.nproc_per_node}) "
                f"x accumulation_steps ({self.accumulation_steps})"
            )
        host, _, port = self.rdzv_endpoint.rpartition(":")
        if self.nnodes > 1 and not (host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"rdzv_endpoint {self.rdzv_endpoint!r} is not host:port (the head node's address)")
        return self


class SanityParams(Section):
    """make sanity: the train recipe on one fixed batch; a loss that won't reach ~0 means broken code or data."""

    steps: int = Field(300, ge=1, description="optimizer steps on the one batch")
    batch_size: int = Field(16, ge=1)
    lr: float = Field(0.01, gt=0, description="constant learning rate (no warmup, no decay)")
    max_loss: float = Field(0.05, gt=0, description="the loss must fall below this for the check to pass")


class EvaluateParams(Section):
    batch_size: int = Field(256, ge=1)
    gallery_images: int = Field(16, ge=1, description="test images with the highest loss in errors_gallery.png")
    label_errors: int = Field(
        100, ge=0, description="length of label_errors.json: the accepted images likeliest mislabelled, worst first"
    )


class Int8Params(Section):
    calibration_images: int = Field(256, ge=1, description="seeded sample of training images that sets INT8 ranges")
    per_channel: bool = Field(False, description="per-channel weight scales instead of one per tensor")
    keep_head_fp32: bool = Field(True, description="leave the classifier head (last Gemm/MatMul) in fp32")
    max_accuracy_drop: float = Field(0.01, ge=0, le=1, description="test accuracy INT8 may lose vs fp32 ONNX")
    min_agreement: float = Field(0.98, ge=0, le=1, description="top-1 agreement INT8 vs fp32 ONNX")


class TimingParams(Section):
    batch_sizes: tuple[Annotated[int, Field(ge=1)], ...] = Field((1, 32), min_length=1)
    repeats: int = Field(20, ge=1, description="timed calls per runtime and batch size; the median is kept")


class ExportParams(Section):
    formats: tuple[Literal["onnx", "onnx_int8", "torchscript"], ...] = Field(
        ("onnx", "onnx_int8", "torchscript"), description="onnx is required: it is the served model"
    )
    opset: int = Field(18, ge=13)
    min_agreement: float = Field(1.0, ge=0, le=1, description="top-1 agreement ONNX/TorchScript vs PyTorch")
    max_abs_diff: float = Field(1e-3, gt=0, description="largest |logit difference| allowed")
    batch_size: int = Field(256, ge=1)
    threads: int = Field(1, ge=0, description="torch and onnxruntime threads for scoring and timing; 0 = all cores")
    int8: Int8Params = Int8Params()
    timing: TimingParams = TimingParams()

    @model_validator(mode="after")
    def _formats(self) -> ExportParams:
        if "onnx" not in self.formats:
            raise ValueError(f"formats must include onnx (the served model), got {list(self.formats)}")
        if len(set(self.formats)) != len(self.formats):
            raise ValueError(f"formats lists a format twice: {list(self.formats)}")
        return self


class Rule(Section):
    metric: str = Field(description="dotted key into the metrics, e.g. accuracy; * matches every key at its level")
    direction: Literal["higher", "lower", "equal"] = Field("higher", description="equal: must match the baseline")
    abs_tol: float = Field(0.0, ge=0, description="allowed worsening, absolute")
    rel_tol: float = Field(0.0, ge=0, description="allowed worsening, relative to the baseline")
    weight: float = Field(
        1.0,
        gt=0,
        description="its share of the gate's alpha against the other rules of its group (the whole test "
        "set, or one class), relative; a * rule's keys each get it (tasks/release/family.py)",
    )


class RegressionParams(Section):
    """check_regression: the exported model and the promoted baseline, both scored on today's test split, compared
    rule by rule; a rule fails when the worsening is beyond its tolerance and a paired test finds it not chance."""

    # (test_set_sha256 is no rule any more: the baseline is re-scored on today's test set, so it is equal by
    # construction; an older params.yaml that still lists it passes it.)
    rules: tuple[Rule, ...] = (
        Rule(metric="accuracy", abs_tol=0.02, weight=3.0),
        Rule(metric="macro_f1", abs_tol=0.02),
        Rule(metric="per_class.*.recall", abs_tol=0.05),
    )
    alpha: float = Field(
        0.05,
        gt=0,
        lt=1,
        description="the gate's family-wise level: a rule fails only when its worsening is beyond tolerance and its "
        "one-sided p-value (McNemar's exact test, or the paired sign-flip test), weighted-Holm adjusted over the "
        "rules that can fail, is below alpha",
    )
    whole_share: float = Field(
        0.8,
        gt=0,
        lt=1,
        description="the share of alpha the whole-test-set rules (accuracy, macro metrics) keep "
        "while per-class rules are in the family; the per-class rules share the rest (tasks/release/family.py)",
    )
    unjudged: Literal["warn", "fail"] = Field(
        "warn", description="a rule whose test images are too few to judge: warn (the verdict says so) or fail"
    )
    batch_size: int = Field(256, ge=1, description="images per onnxruntime call when scoring the test split")
    drift_servers: tuple[str, ...] = Field(
        (),
        description="servers (http[s]://host[:port]) regression-flow may read /drift from, besides 127.0.0.1/localhost",
    )
    drift_urls: tuple[str, ...] = Field(
        (),
        description="replicas (http[s]://host[:port]) whose /drift regression-flow merges into one verdict, PSI on "
        "their summed window counts; empty: only the server its `server` parameter names, if any",
    )
    drift_unreadable_nights: int = Field(
        3,
        ge=1,
        description="regression-flow runs in a row (same deployment, same server) that could not read /drift "
        "before the run ends in the DriftUnread state (the drift automation notifies)",
    )


class DriftParams(Section):
    """The server's drift watch (GET /drift): its last `window` predictions against the model's test-split reference.

    Thresholds are calibrated at export (tasks/release/drift.py) so that traffic drawn like the test split reads
    as drift in at most `false_alarm_rate` of windows, whatever the number of classes; a number given for a
    statistic here is used as it is instead (null: calibrated)."""

    window: int = Field(500, ge=10, le=10_000, description="predictions in the sliding window (all workers)")
    min_predictions: int = Field(200, ge=10, description="fewer predictions in the window: 'not enough data'")
    false_alarm_rate: float = Field(
        0.01, gt=0, lt=0.5, description="share of windows of test-like traffic that may read as drift (calibrated)"
    )
    class_mix_psi: float | None = Field(None, gt=0, description="fixed PSI threshold of the predicted-class mix")
    top1_psi: float | None = Field(None, gt=0, description="fixed PSI threshold of top-1 probability (deciles)")
    margin_psi: float | None = Field(None, gt=0, description="fixed PSI threshold of top-1 minus top-2 (deciles)")

    @model_validator(mode="after")
    def _min_fits(self) -> DriftParams:
        if self.min_predictions > self.window:
            raise ValueError(f"min_predictions {self.min_predictions} > window {self.window}: never enough data")
        return self


class ServeParams(Section):
    """make serve: the production ONNX model behind FastAPI (not a DVC stage; read by serving/)."""

    host: str = Field("127.0.0.1", description="address uvicorn binds")
    port: int = Field(8000, ge=1, le=65535)
    workers: int = Field(1, ge=1, description="uvicorn worker processes, each with its own onnxruntime session")
    streams: int = Field(
        0,
        ge=0,
        description="inference runs at once per worker, each on its own thread; 0 = cores / (workers x threads)",
    )
    threads: int = Field(
        1, ge=1, description="onnxruntime intra-op threads per stream; workers x streams x threads <= cores"
    )
    max_batch: int = Field(
        8,
        ge=1,
        description="while every stream is busy, up to this many waiting images go into one call; 1 = no batching",
    )
    max_queue: int = Field(256, ge=1, description="images waiting for a stream; more get 503 overloaded")
    max_connections: int = Field(
        100, ge=1, description="open connections and requests per worker (uvicorn's limit_concurrency); more get 503"
    )
    max_body_bytes: int = Field(10 * 2**20, ge=1024, description="larger request bodies get 413, counted while reading")
    max_batch_files: int = Field(32, ge=1, description="images per /predict/batch request; more get 413")
    max_pixels: int = Field(40_000_000, ge=1, description="more pixels in the header: 413 before decoding")
    top_k: int = Field(5, ge=1, description="classes returned per image")
    warmup_runs: int = Field(3, ge=0, description="inferences before /ready says ready")
    low_confidence: float = Field(0.5, ge=0, le=1, description="top-1 probability below this: logged, kept for review")
    review_dir: Path = Field(Path("data/review"), description="low-confidence inputs: <class>/<sha256>.<ext> + .json")
    review_max_files: int = Field(1000, ge=0, description="stop saving to review_dir once it holds this many images")
    review_max_file_bytes: int = Field(2 * 2**20, ge=0, description="larger low-confidence uploads: logged, not saved")
    review_port: int = Field(8010, ge=1, le=65535, description="make review: the review page on 127.0.0.1:<this port>")
    drift: DriftParams = DriftParams()


class Params(Section):
    seed: int = Field(42, ge=0, description="the one seed every other seed derives from")
    paths: Paths = Paths()
    data: DataParams = DataParams()
    generate: GenerateParams = GenerateParams()
    preprocess: PreprocessParams = PreprocessParams()
    train: TrainParams = TrainParams()
    sanity: SanityParams = SanityParams()
    evaluate: EvaluateParams = EvaluateParams()
    export: ExportParams = ExportParams()
    regression: RegressionParams = RegressionParams()
    serve: ServeParams = ServeParams()
    tracking: TrackingParams = TrackingParams()
    sweep: SweepParams = SweepParams()


def parse_params(raw: object, source: str = "params.yaml") -> Params:
    try:
        return Params.model_validate(raw if raw is not None else {})
    except ValidationError as exc:
        lines = "\n  ".join(describe_errors(exc, Params))
        raise ParamsError(f"{source}: invalid params\n  {lines}") from None


def load_params(path: Path = PARAMS_FILE) -> Params:
    try:
        raw = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # libyaml where there
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
