"""The machine-side inputs of a stage, which params.yaml does not hold: library versions, the CPU features
that choose kernels, the cores this process may use. Torch-free: the environment stage adds what torch
resolves (tasks/environment.py).

Each stage's record is reports/environment/<stage>.json, a dependency of that stage in dvc.yaml, so a
machine that would compute differently (another torch, a CPU with native bf16, more cores) reruns it,
and `make check-reproduced` can say which of these differed from the committed run.
"""

from __future__ import annotations

import hashlib
import os
import platform
from importlib import metadata
from pathlib import Path

import yaml

# The libraries whose code computes each stage's outputs (names as in constraints.txt). Their installed
# versions go into the stage's record: a different one reruns the stage.
LIBRARIES: dict[str, tuple[str, ...]] = {
    "generate": ("numpy", "pillow"),
    "preprocess": ("numpy", "pillow", "pyarrow"),
    "train": ("torch", "torchvision", "numpy", "pillow", "pyarrow"),
    "evaluate": ("torch", "torchvision", "numpy", "pyarrow", "matplotlib"),
    "export": ("torch", "torchvision", "onnx", "onnxscript", "onnxruntime", "numpy", "pyarrow"),
    "check_regression": ("onnxruntime", "numpy", "pyarrow"),
}

# /proc/cpuinfo flags that make torch (ATen, oneDNN) or onnxruntime pick other kernels.
KERNEL_FLAGS = (
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
    "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
)  # fmt: skip


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (a cpuset, a container, a Slurm allocation),
    not the machine's count, which oversubscribes them."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS)
        return max(1, os.cpu_count() or 1)


def library_versions(names: tuple[str, ...]) -> dict[str, str]:
    """Installed version of each library, `absent` when it is not installed."""
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


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


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """The kernel-choosing flags this CPU has (Linux); [] where /proc/cpuinfo says nothing."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            have = set(line.split(":", 1)[1].split())
            return [flag for flag in KERNEL_FLAGS if flag in have]
    return []


def dvc_experiment() -> str | None:
    """The experiment `dvc exp run` is running (DVC sets DVC_EXP_NAME for the stages' commands), if any."""
    return os.environ.get("DVC_EXP_NAME") or None


def machine() -> dict[str, str]:
    return {"python": platform.python_version(), "system": platform.system(), "arch": platform.machine()}


def stage_code(stage: str, root: Path) -> dict[str, str]:
    """The code a stage runs, as dvc.yaml declares it: every dep of `stage` under tasks/ -> its md5 (the
    digest DVC records in dvc.lock). Read from `root`'s own dvc.yaml and files: the code being run."""
    dvc_yaml = root / "dvc.yaml"
    try:
        deps = yaml.safe_load(dvc_yaml.read_text())["stages"][stage].get("deps") or []
    except (OSError, KeyError, TypeError, yaml.YAMLError) as exc:
        raise ValueError(f"{dvc_yaml}: cannot read stage {stage}'s deps ({type(exc).__name__}: {exc})") from None
    code = {}
    for dep in deps:
        if isinstance(dep, str) and dep.startswith("tasks/") and "${" not in dep:
            code[dep] = hashlib.md5((root / dep).read_bytes()).hexdigest()
    return dict(sorted(code.items()))
