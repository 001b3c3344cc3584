"""The production model and the promoted baseline, resolved in one place for serving, the nightly flow,
check_regression and promote.

The production model is the promoted baseline's ONNX (baseline/model.onnx, its hash recorded in
baseline/model.json by `make promote`) when there is one, else the export stage's (paths.onnx, its
hash recorded in reports/export.json). It is never a file without a recorded hash, and the hash is
checked before onnxruntime reads a byte. `make promote` also records the promoted test set
(baseline/test_set.json: each test image's content sha256 and class), so a verdict can say which of today's
test images the baseline was not promoted on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.core.errors import StageError
from tasks.core.io import read_json, sha256_bytes, sha256_file
from tasks.core.paths import BASELINE_METRICS, BASELINE_MODEL, BASELINE_ONNX, Paths
from tasks.release.inference import ModelIntegrityError, ModelMetadataError, OnnxModel, verify_sha256

BASELINE_TEST_SET = "test_set.json"  # the promoted test set: {test_set_sha256, class_names, images: {sha256: class}}


class ProductionModelError(StageError):
    """No production model, or no valid recorded hash to check it against."""


@dataclass(frozen=True)
class ProductionModel:
    path: Path
    expected_sha256: str
    source: str  # "baseline" (promoted), "export" (the last dvc repro) or "revision" (paths.onnx at a git revision)
    detail: str  # where the file and its expected hash come from, for logs and verdicts

    def load(self, threads: int = 0) -> OnnxModel:
        """The onnxruntime session, built only after the file's bytes matched the recorded hash."""
        return OnnxModel.load(self.path, expected_sha256=self.expected_sha256, threads=threads)

    def verify(self) -> str:
        """The file's sha256, after checking it is the recorded one (ModelIntegrityError naming the file if not)."""
        return verify_sha256(self.path, self.path.read_bytes(), self.expected_sha256)


def _recorded_sha256(record: Path, key: str = "onnx_sha256") -> str:
    try:
        digest = read_json(record).get(key)
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise ProductionModelError(f"{record}: not a JSON object with {key}: {exc}") from None
    if not isinstance(digest, str) or len(digest) != 64:
        raise ProductionModelError(f"{record}: no valid {key} (got {digest!r})")
    return digest


def promoted_model(paths: Paths, root: Path = Path()) -> ProductionModel | None:
    """baseline/model.onnx with the hash `make promote` recorded for it; None when nothing was promoted.

    A promoted model that DVC tracks but whose files are absent is an error (run `dvc pull`), not
    "nothing promoted", and so is one half of a baseline without the other."""
    return baseline_model(root / paths.baseline,
                          f"{paths.baseline_onnx}, hash recorded in {paths.baseline_model_record}")  # fmt: skip


def baseline_model(baseline_dir: Path, detail: str = "") -> ProductionModel | None:
    """`promoted_model` for a baseline folder: <baseline_dir>/model.onnx with the hash in model.json, or None."""
    onnx, record = baseline_dir / BASELINE_ONNX, baseline_dir / BASELINE_MODEL
    present = [path for path in (record, onnx) if path.is_file()]
    if not present:
        tracked = [path for path in (record, onnx) if path.with_name(path.name + ".dvc").is_file()]
        if tracked:
            raise ProductionModelError(f"{tracked[0]}: tracked by DVC but missing; run `dvc pull {tracked[0]}.dvc`")
        return None
    if len(present) < 2:
        missing = onnx if record in present else record
        raise ProductionModelError(f"{missing}: missing beside {present[0]}; promote again (make promote)")
    return ProductionModel(onnx, _recorded_sha256(record), "baseline", detail or f"{onnx}, hash recorded in {record}")


def production_model(paths: Paths, root: Path = Path()) -> ProductionModel:
    """The promoted baseline's model when there is one, else the exported model; never an unverified file."""
    promoted = promoted_model(paths, root)
    if promoted is not None:
        return promoted
    onnx = root / paths.onnx
    if not onnx.is_file():
        raise ProductionModelError(
            f"no production model: neither {root / paths.baseline_onnx} (make promote) nor {onnx} (dvc repro)"
        )
    digest = recorded_onnx_sha256(root / paths.export_report)
    return ProductionModel(onnx, digest, "export", f"{paths.onnx}, hash recorded in {paths.export_report}")


def recorded_onnx_sha256(export_report: Path) -> str:
    """The hash the export stage recorded for the ONNX file it proved equal to PyTorch."""
    if not export_report.is_file():
        raise ProductionModelError(f"{export_report}: missing; run the export stage first (dvc repro export)")
    return _recorded_sha256(export_report)


def load_verified_model(onnx_path: Path, export_report: Path) -> OnnxModel:
    """The ONNX model, refused before use when its bytes are not the ones export recorded."""
    try:
        return OnnxModel.load(onnx_path, expected_sha256=recorded_onnx_sha256(export_report))
    except (ModelIntegrityError, ModelMetadataError, FileNotFoundError) as exc:
        raise StageError(str(exc)) from None


def load_baseline(baseline_dir: Path) -> dict[str, Any] | None:
    """baseline/metrics.json, or None when nothing was promoted yet.

    A baseline that DVC tracks (metrics.json.dvc) but whose file is absent is an error, not
    "no baseline": a CI job that forgot `dvc pull` must not pass the gate by accident.
    """
    path = baseline_dir / BASELINE_METRICS
    tracked = path.with_name(path.name + ".dvc")
    if not path.is_file():
        if tracked.is_file():
            raise StageError(
                f"{path}: the baseline is tracked by DVC ({tracked}) but missing; run `dvc pull {tracked}`"
            )
        return None
    try:
        baseline = read_json(path)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StageError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(baseline, dict):
        raise StageError(f"{path}: expected a JSON object of metrics, got {type(baseline).__name__}")
    return baseline


def load_promoted_test_set(baseline_dir: Path) -> dict[str, str] | None:
    """The promoted test set from baseline/test_set.json: {image content sha256: class name}; None when the
    baseline was promoted before `make promote` recorded it (or nothing was promoted)."""
    path = baseline_dir / BASELINE_TEST_SET
    if not path.is_file():
        return None
    try:
        images = read_json(path).get("images")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise StageError(f"{path}: not a JSON object with images: {exc}; promote again (make promote)") from None
    if not isinstance(images, dict) or not all(isinstance(v, str) for v in images.values()):
        raise StageError(f"{path}: images is not an object of sha256 -> class name; promote again (make promote)")
    return images


def baseline_sha256(baseline_dir: Path) -> str | None:
    """The promoted baseline as one hash: sha256 over the sha256 of each of its files (metrics, model record,
    ONNX, test set) that is there; None when nothing was promoted. A verdict records it, so a verdict computed
    against another baseline (an older one, none, a teammate's pulled since) is never taken for this one's.
    (test_set.json alone is no baseline: it counts only beside one of the others.)"""
    files = [baseline_dir / name for name in (BASELINE_METRICS, BASELINE_MODEL, BASELINE_ONNX)]
    present = [(path.name, sha256_file(path)) for path in files if path.is_file()]
    if not present:
        return None
    test_set = baseline_dir / BASELINE_TEST_SET
    if test_set.is_file():
        present.append((test_set.name, sha256_file(test_set)))
    return sha256_bytes(json.dumps(present).encode())
