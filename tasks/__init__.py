"""The pipeline's stages (`python -m tasks.<stage>`, as dvc.yaml runs them) and their support modules.

Run as a stage, the package first checks that this Python has the pipeline's dependencies: DVC runs
each stage with the `python` on PATH, so `.venv/bin/dvc repro` from a shell without the venv would
otherwise die in a `ModuleNotFoundError` deep inside an import. It also shortens how long OpenMP's
idle threads spin, so two jobs sharing the cores do not collapse.
"""

from __future__ import annotations

import os
import sys
from importlib.util import find_spec

# Top-level modules every stage needs between them (requirements.txt, by import name).
STAGE_MODULES = ("numpy", "yaml", "pydantic", "PIL", "pyarrow", "torch", "torchvision", "onnx", "onnxruntime")


def _run_as_stage() -> bool:
    argv = getattr(sys, "orig_argv", [])
    return any(a == "-m" and b.startswith("tasks.") for a, b in zip(argv, argv[1:], strict=False))


def check_interpreter(modules: tuple[str, ...] = STAGE_MODULES) -> None:
    """Exit 2 with a one-line fix when this interpreter lacks any of `modules`."""
    missing = [name for name in modules if find_spec(name) is None]
    if missing:
        print(
            f"error: {sys.executable} lacks the pipeline's dependencies ({', '.join(missing)}). DVC runs the "
            "stages with the `python` on PATH: activate the project's venv first (`source .venv/bin/activate`, "
            "made by `make setup`), or run `make run`",
            file=sys.stderr,
        )
        sys.exit(2)


def prepare_stage_process() -> None:
    check_interpreter()
    # OpenMP threads that wait for work spin for 10,000 iterations, not libgomp's 300,000, before they
    # sleep (read once, when torch loads OpenMP): as fast alone, and two trainings sharing the cores
    # slow each other about 2.4x instead of 7x (bench/bench_shared_cores.py). Your own setting wins.
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")


if _run_as_stage():
    prepare_stage_process()
