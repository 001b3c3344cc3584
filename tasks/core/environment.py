"""The machine-side inputs of a stage, which params.yaml does not hold: library versions, the CPU features
that choose kernels, the cores this process may use. Torch-free, so that the environment stage, which runs
on every `dvc repro`, need not import torch (2 s) on a machine without a GPU: the CPU facts torch would
give (its kernel capability, native bf16) are read from /proc/cpuinfo by torch's own rules, and the train
stage checks that torch agrees (`cpu_facts_disagree`). Where these rules cannot answer (another CPU
architecture, ATEN_CPU_CAPABILITY set, a GPU) the stage asks torch.

Each stage's record is reports/environment/<stage>.json, a dependency of that stage in dvc.yaml, so a
machine that would compute differently (another torch, a CPU with native bf16, more cores) reruns it,
and `make check-reproduced` can say which of these differed from the committed run.
"""

from __future__ import annotations

import functools
import os
import platform
from importlib import metadata
from pathlib import Path

# The libraries whose code writes bytes into each stage's outputs (names as in constraints.txt): what the
# stage's code imports (tests/stages/test_environment.py checks it against dvc.yaml's deps), plus what those
# call to write (matplotlib saves its PNGs through pillow). Their installed versions go into the stage's
# record: a different one reruns the stage. pydantic and pyyaml read and serialise params.yaml, whose values
# and hashes land in the outputs.
_PARAMS = ("pydantic", "pyyaml")
LIBRARIES: dict[str, tuple[str, ...]] = {
    "generate": ("numpy", "pillow", *_PARAMS),
    "preprocess": ("numpy", "pillow", "pyarrow", *_PARAMS),
    "train": (
        "torch",
        "torchvision",
        "numpy",
        "pillow",
        "pyarrow",
        "matplotlib",
        "scikit-learn",
        "scikit-image",
        "scipy",
        "timm",
        "safetensors",
        *_PARAMS,
    ),  # scikit-*: the mirror check and the feature probe; timm: its models; safetensors: the hub's weights files
    "evaluate": ("torch", "torchvision", "timm", "numpy", "pillow", "pyarrow", "matplotlib", *_PARAMS),
    "export": (
        "torch",
        "torchvision",
        "timm",
        "onnx",
        "onnxscript",
        "onnxruntime",
        "numpy",
        "pillow",
        "pyarrow",
        *_PARAMS,
    ),
    "check_regression": ("onnxruntime", "numpy", "pillow", "pyarrow", "scipy", *_PARAMS),  # scipy: the paired tests
}
# Imported by stage code but writing no byte of any output: progress bars on stderr, DVC's state (read), MLflow.
WRITES_NO_OUTPUT = (
    "tqdm",
    "dvc",
    "dvc-data",
    "dvc-objects",
    "mlflow",
    "mlflow-skinny",
    "mlflow-tracing",
    "psutil",
    "huggingface_hub",
)  # dvc*: the ledger's hashes of what a stage wrote (tasks/core/provenance.py); mlflow: the experiment table;
# psutil: which process holds DVC's locks (private_api.dvc_busy, for the review page); huggingface_hub: make
# add-weights' download (timm_weights.download), which no stage calls

# /proc/cpuinfo flags that make torch (ATen, oneDNN) or onnxruntime pick other kernels: x86's `flags`, then
# aarch64's `Features` (NEON dot product, half precision, SVE, bf16 and int8 matrix instructions).
KERNEL_FLAGS = (
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx_vnni",
    "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
    "asimd", "asimdhp", "asimddp", "fphp", "sve", "sve2", "svebf16", "bf16", "i8mm", "sme",
)  # fmt: skip
NATIVE_BF16_ENV = "IMAGEPIPE_NATIVE_BF16"  # 1 or 0: overrides the CPU's own answer (tests; a mixed fleet)
HOOKS_ENV = "IMAGEPIPE_TRAIN_HOOKS"  # a test's training hooks (tasks/training/hooks.py)
ALLOW_HOOKS_ENV = "IMAGEPIPE_ALLOW_TEST_HOOKS"


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (a cpuset, a container, a Slurm allocation),
    not the machine's count, which oversubscribes them."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS)
        return max(1, os.cpu_count() or 1)


def cpu_threads(requested: int, processes_per_node: int) -> int:
    """train.threads, or (0) the cores split between this node's processes."""
    return requested or max(1, usable_cores() // processes_per_node)


@functools.cache
def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def library_versions(names: tuple[str, ...]) -> dict[str, str]:
    """Installed version of each library, `absent` when it is not installed (each looked up once a process:
    the environment stage asks for six stages' lists, mostly the same libraries)."""
    return {name: _version(name) for name in names}


def pinned(constraints: Path = Path("constraints.txt")) -> dict[str, str]:
    """name -> version of constraints.txt's `name==version` lines (the tested environment); {} without it."""
    if not constraints.is_file():
        return {}
    pins = {}
    for line in constraints.read_text().splitlines():
        name, sep, version = line.split("#", 1)[0].strip().partition("==")
        if sep:
            pins[name.strip().lower()] = version.strip()
    return pins


def off_pin(versions: dict[str, str], pins: dict[str, str]) -> dict[str, str]:
    """The libraries whose installed version is not constraints.txt's: `name: installed (pinned X)`."""
    return {name: f"{v} (constraints.txt pins {pins[name]})" for name, v in versions.items()
            if name in pins and pins[name] != v}  # fmt: skip


def cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """Every feature flag of the first CPU (Linux: x86 `flags`, aarch64 `Features`); empty where unknown."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """The kernel-choosing flags this CPU has (Linux); [] where /proc/cpuinfo says nothing."""
    have = cpu_features(cpuinfo)
    return [flag for flag in KERNEL_FLAGS if flag in have]


def cpu_capability(features: set[str], arch: str | None = None) -> str | None:
    """torch.backends.cpu.get_cpu_capability() by ATen's own rule (DispatchStub.cpp): AVX512 with avx512vl,
    avx512bw, avx512dq and fma; AVX2 with avx2 and fma; else DEFAULT. None where the rule does not apply (not
    x86, or ATEN_CPU_CAPABILITY set): ask torch."""
    if (arch or platform.machine()) not in ("x86_64", "AMD64") or os.environ.get("ATEN_CPU_CAPABILITY") or not features:
        return None
    if {"avx512vl", "avx512bw", "avx512dq", "fma"} <= features:
        return "AVX512"
    return "AVX2" if {"avx2", "fma"} <= features else "DEFAULT"


def native_bf16(features: set[str]) -> bool:
    """bf16 arithmetic in hardware (AVX-512 BF16 or AMX), as torch.cpu._is_avx512_bf16_supported /
    _is_amx_tile_supported answer; IMAGEPIPE_NATIVE_BF16=1/0 overrides it."""
    forced = os.environ.get(NATIVE_BF16_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    return bool({"avx512_bf16", "amx_tile"} & features)


def cpu_precision(requested: str, has_native_bf16: bool) -> str:
    """train.precision on a CPU: auto is bf16 where it is native, else fp32 (emulated bf16 ran 2.3x slower)."""
    if requested != "auto":
        return requested
    return "bf16" if has_native_bf16 else "fp32"


def cpu_memory_format(requested: str, precision: str, has_native_bf16: bool, capability: str) -> str:
    """train.memory_format on a CPU. auto: the format that measured faster (bench/bench_train.py, bare step):
    channels_last for bf16 on a CPU that has it (1.21x) and for fp32 on an AVX2 CPU (1.11x and 1.12x in two
    runs); contiguous elsewhere (fp32 on the earlier CPU without native bf16 measured 0.90x and 1.03x)."""
    if requested != "auto":
        return requested
    if precision == "bf16" and has_native_bf16:
        return "channels_last"
    return "channels_last" if precision == "fp32" and capability == "AVX2" else "contiguous"


def cpu_facts_disagree(torch_capability: str, torch_native_bf16: bool) -> str | None:
    """What /proc/cpuinfo (read by the environment stage, torch-free) says otherwise than torch, or None."""
    features = cpu_features()
    capability = cpu_capability(features)
    if capability is None:
        return None
    differ = []
    if capability != torch_capability:
        differ.append(f"kernel capability {capability} by /proc/cpuinfo, {torch_capability} by torch")
    if native_bf16(features) != torch_native_bf16:
        differ.append(f"native bf16 {native_bf16(features)} by /proc/cpuinfo, {torch_native_bf16} by torch")
    return "; ".join(differ) or None


def may_have_cuda() -> bool:
    """Could torch see a CUDA device here? Not without NVIDIA's driver: then `auto` is the CPU, as torch says."""
    return Path("/proc/driver/nvidia/version").exists() or any(Path("/dev").glob("nvidia[0-9]*"))


def dvc_experiment() -> str | None:
    """The experiment `dvc exp run` is running (DVC sets DVC_EXP_NAME for the stages' commands), if any."""
    return os.environ.get("DVC_EXP_NAME") or None


def machine() -> dict[str, str]:
    return {"python": platform.python_version(), "system": platform.system(), "arch": platform.machine()}
