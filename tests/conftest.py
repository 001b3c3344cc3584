"""Shared fixtures: tiny ImageFolders on disk and throwaway copies of the project as real git+DVC repos."""

from __future__ import annotations

import colorsys
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]

# Offline and quiet: no telemetry from DVC or Prefect during tests.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
PROJECT_FILES = ("tasks", "flows", "baseline", "dvc.yaml", "params.yaml")

# A run small enough for a test: 10 x 12 generated images at 32 px, one short epoch.
TINY = {
    "generate": {"images_per_class": 12, "min_side": 24, "max_side": 64, "workers": 1},
    "preprocess": {"image_size": 32, "workers": 1, "val_fraction": 0.2, "test_fraction": 0.2},
    "train": {"epochs": 1, "batch_size": 16, "lr": 0.01, "warmup_epochs": 0.5, "threads": 1},
    # A model trained for one short epoch has large, unsettled logits; fp32 rounding differences
    # between PyTorch and onnxruntime scale with them. It is also near chance, with near-tied logits
    # that INT8 rounding flips: on ~20 test images one flip is 5 points. (INT8 gates at their
    # defaults are tested on a trained model in tests/test_export.py.)
    "export": {
        "max_abs_diff": 0.01,
        "int8": {"max_accuracy_drop": 0.25, "min_agreement": 0.5},
        "timing": {"repeats": 3},
    },
}


def deep_update(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        out[key] = deep_update(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def make_imagefolder(root: Path, classes: int = 3, per_class: int = 20, seed: int = 0) -> Path:
    """Classes told apart by colour, sizes and formats varied."""
    rng = np.random.default_rng(seed)
    for c in range(classes):
        folder = root / f"class_{c}"
        folder.mkdir(parents=True, exist_ok=True)
        tint = np.array([(c * 97) % 256, (c * 53 + 80) % 256, (c * 191 + 30) % 256])
        for i in range(per_class):
            h, w = rng.integers(20, 80, size=2)
            pixels = (rng.random((h, w, 3)) * 60 + tint * 0.7).clip(0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(folder / (f"{i:03d}.png" if i % 2 else f"{i:03d}.jpg"))
    return root


SHAPES = ("circle", "square", "triangle", "diamond", "star", "cross", "ring", "hexagon", "pentagon", "bar")


def _shape_polygon(kind: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    sides = {"triangle": 3, "diamond": 4, "pentagon": 5, "hexagon": 6}
    if kind in sides:
        n = sides[kind]
        return [(cx + r * np.sin(2 * np.pi * k / n), cy - r * np.cos(2 * np.pi * k / n)) for k in range(n)]
    if kind == "star":
        return [(cx + (r if k % 2 == 0 else r * 0.45) * np.sin(np.pi * k / 5),
                 cy - (r if k % 2 == 0 else r * 0.45) * np.cos(np.pi * k / 5)) for k in range(10)]  # fmt: skip
    raise ValueError(kind)


def draw_shapes_folder(root: Path, classes: int, per_class: int, seed: int = 0) -> Path:
    """A user-like ImageFolder of drawn shapes: one shape per image (mirror-symmetric, so a flip keeps
    the class) in the class's hue on a dull background, at a random size and place inside the central square
    (the part preprocessing keeps); images of 40-200 px, aspect 3:4 to 4:3, some grayscale, saved as
    JPEG, PNG, BMP or WebP."""
    from PIL import ImageDraw

    rng = np.random.default_rng(seed)
    for index, kind in enumerate(SHAPES[:classes]):
        folder = root / kind
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            w = int(rng.integers(40, 200))
            h = int(w * rng.uniform(0.75, 1.34))  # photo-like aspect ratios
            # Each class has its shape and its hue (jittered), as in many real datasets colour carries
            # part of the class; the background is any dull colour.
            background = tuple(int(v) for v in rng.integers(40, 140) + rng.integers(-30, 30, size=3))
            hue = (index / classes + rng.uniform(-0.03, 0.03)) % 1.0
            fill = tuple(int(255 * v) for v in colorsys.hsv_to_rgb(hue, rng.uniform(0.6, 1.0), rng.uniform(0.7, 1.0)))
            image = Image.new("RGB", (w, h), background)
            draw = ImageDraw.Draw(image)
            # Inside the central square, which preprocessing keeps (shorter side resized, centre crop).
            side = min(w, h)
            r = side * rng.uniform(0.2, 0.4)
            cx = (w - side) / 2 + rng.uniform(r, side - r)
            cy = (h - side) / 2 + rng.uniform(r, side - r)
            box = (cx - r, cy - r, cx + r, cy + r)
            if kind == "circle":
                draw.ellipse(box, fill=fill)
            elif kind == "ring":
                draw.ellipse(box, outline=fill, width=max(2, int(r * 0.3)))
            elif kind == "square":
                draw.rectangle((cx - r * 0.8, cy - r * 0.8, cx + r * 0.8, cy + r * 0.8), fill=fill)
            elif kind == "bar":
                draw.rectangle((cx - r, cy - r * 0.3, cx + r, cy + r * 0.3), fill=fill)
            elif kind == "cross":
                draw.rectangle((cx - r, cy - r * 0.25, cx + r, cy + r * 0.25), fill=fill)
                draw.rectangle((cx - r * 0.25, cy - r, cx + r * 0.25, cy + r), fill=fill)
            else:
                draw.polygon(_shape_polygon(kind, cx, cy, r), fill=fill)
            if rng.random() < 0.2:
                image = image.convert("L")
            suffix = (".jpg", ".png", ".bmp", ".webp")[i % 4]
            image.save(folder / f"{kind}_{i:04d}{suffix}")
    return root


def env_with_venv() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_train(repo: Path, fault: str | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """`python -m tasks.train` in `repo`, with IMAGEPIPE_FAULT set to `fault` (tasks.faults) or unset.
    Under DDP every rank sees it: the whole job dies, as on a preempted node."""
    env = env_with_venv()
    env.pop("IMAGEPIPE_FAULT", None)
    if fault:
        env["IMAGEPIPE_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "tasks.train"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def sh(args: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, cwd=cwd, env=env_with_venv(), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


def commit(repo: Path, message: str) -> None:
    sh(["git", "add", "-A"], cwd=repo)
    sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message], cwd=repo)


def dvc(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    return sh([sys.executable, "-m", "dvc", *args], cwd=cwd, check=check)


def write_params(repo: Path, update: dict[str, Any]) -> None:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    (repo / "params.yaml").write_text(yaml.safe_dump(deep_update(params, update), sort_keys=False))


def make_project(dest: Path, update: dict[str, Any] | None = None) -> Path:
    """A copy of the project as a fresh git + DVC repository, with params shrunk by `update`."""
    dest.mkdir(parents=True)
    for name in PROJECT_FILES:
        src = ROOT / name
        if src.is_dir():
            # A promoted baseline (make promote: metrics, model.json, model.onnx, their .dvc files) stays
            # behind, so every test project starts with no baseline.
            shutil.copytree(
                src,
                dest / name,
                ignore=shutil.ignore_patterns("__pycache__", "metrics.json", "model.json", "*.onnx", "*.dvc"),
            )
        else:
            shutil.copy2(src, dest / name)
    write_params(dest, deep_update(TINY, update or {}))
    sh(["git", "init", "-q"], cwd=dest)
    dvc("init", "-q", cwd=dest)
    dvc("config", "core.analytics", "false", cwd=dest)
    return dest


@pytest.fixture
def imagefolder(tmp_path: Path) -> Path:
    return make_imagefolder(tmp_path / "images")


@pytest.fixture(scope="session")
def export_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny shards for the export, inference and regression-gate tests, made once per session."""
    from tests.test_export import make_shards

    return make_shards(tmp_path_factory.mktemp("export-data"))


@pytest.fixture(scope="session")
def export_model_file(export_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model.pt trained once on `export_shards`; tests that alter it work on copies."""
    from tests.test_export import train_model

    return train_model(export_shards, tmp_path_factory.mktemp("export-model"))
