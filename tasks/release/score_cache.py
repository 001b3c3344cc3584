"""The models' test scores for the gate, kept between runs: scoring the test split is check_regression's costly
part. Each model's scores are kept in `<paths.runs>/check_regression/` (scores.json for the exported model,
baseline_scores.json for the baseline's; unversioned, like the checkpoints: DVC removes a stage's outputs before
it runs) and reused when they were made from the same ONNX bytes, test split, batch size, stage code and
environment record (`scoring_key`, the one key of the cache); else the model is scored through the serving path
(tasks.release.scoring). A model's bytes are checked against their record before its scores are used.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.core.errors import StageError
from tasks.core.io import read_json, sha256_file, write_json
from tasks.core.params import RegressionParams
from tasks.core.provenance import project_root, stage_code
from tasks.images.imaging import PreprocessSpec
from tasks.images.shards import load_manifest
from tasks.release.inference import ModelIntegrityError, ModelMetadataError, OnnxModel
from tasks.release.production import ProductionModel, load_verified_model, recorded_onnx_sha256
from tasks.release.scoring import SplitScores, score_images, split_images
from tasks.release.verdict import describe_test_set

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Scored:
    onnx_sha256: str
    scores: SplitScores
    key: str  # scoring_key: what the scores were made from


def scoring_key(onnx_sha256: str, shard_dir: Path, batch_size: int, environment_record: Path | None) -> str:
    """The cache's one key: what a model's test scores depend on. The ONNX bytes, the test split (its shards'
    sha256, which cover pixels and labels; its images' content hashes in row order, which name the scores' rows;
    the class names), the batch size, this stage's code as the process loaded it, and its environment record
    (onnxruntime's version, the CPU's flags, the cores). Images added to the train or val split leave it as it was."""
    manifest = load_manifest(shard_dir)
    record = environment_record.read_bytes() if environment_record and environment_record.is_file() else b""
    images = "\n".join(split_images(shard_dir, "test", manifest)).encode()
    key = {"onnx": onnx_sha256, "test_shards": [e["sha256"] for e in manifest["splits"]["test"]["shards"]],
           "test_images": hashlib.sha256(images).hexdigest(), "class_names": manifest["class_names"],
           "batch_size": batch_size, "code": stage_code("check_regression", project_root()),
           "environment": hashlib.sha256(record).hexdigest()}  # fmt: skip
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _reusable(scores_path: Path | None, key: str) -> SplitScores | None:
    """The kept scores when they were made from exactly these inputs, else None."""
    if scores_path is None:
        return None
    try:
        kept = read_json(scores_path)
    except (OSError, ValueError):
        return None
    if not isinstance(kept, dict) or kept.get("key") != key:
        return None
    return SplitScores.from_json(kept)


def _keep(scores_path: Path | None, key: str, scores: SplitScores) -> None:
    if scores_path is not None:
        write_json(scores_path, {"key": key, **scores.to_json()})


def _score(model: OnnxModel, shard_dir: Path, batch_size: int) -> SplitScores:
    try:
        return score_images(model, shard_dir, "test", batch_size)
    except ValueError as exc:
        raise StageError(str(exc)) from None


def score_candidate(params: RegressionParams, onnx_path: Path, export_report: Path, shard_dir: Path,
                    scores_path: Path | None, environment_record: Path | None) -> Scored:  # fmt: skip
    """The exported model's test scores: reused when nothing they depend on changed, else scored through the
    serving path. Either way the file's bytes are checked against export.json first."""
    onnx_sha256 = sha256_file(onnx_path) if onnx_path.is_file() else ""
    key = scoring_key(onnx_sha256, shard_dir, params.batch_size, environment_record)
    if onnx_sha256 == recorded_onnx_sha256(export_report):
        reused = _reusable(scores_path, key)
        if reused is not None:
            log.info("test scores of %s reused from %s: the same ONNX bytes, test shards, code and environment",
                     onnx_path, scores_path)  # fmt: skip
            return Scored(onnx_sha256, reused, key)
    model = load_verified_model(onnx_path, export_report)  # refuses bytes other than the recorded ones
    scores = _score(model, shard_dir, params.batch_size)
    _keep(scores_path, key, scores)
    return Scored(model.sha256, scores, key)


def _unscorable(model: OnnxModel, shard_dir: Path, recorded: dict[str, Any], candidate: SplitScores) -> str:
    """Why the baseline's model cannot be scored on these shards (other classes, other pixels), or ''."""
    shards = PreprocessSpec.model_validate(load_manifest(shard_dir)["spec"])
    if model.class_names != shards.class_names:
        return (f"different test set: the baseline was scored on {describe_test_set(recorded)}; this run on "
                f"{describe_test_set(candidate.metrics)}. The classes differ, so the baseline cannot be re-scored on "
                "this test set: to gate models of these classes, promote one of them, saying why "
                '(`make promote ACCEPT="<why>"`)')  # fmt: skip
    theirs, ours = model.spec, shards
    if (theirs.image_size, theirs.resize, theirs.interpolation) != (ours.image_size, ours.resize, ours.interpolation):
        return (f"different test set: the baseline model takes {theirs.image_size}x{theirs.image_size} images "
                f"({theirs.resize}, {theirs.interpolation}), this run's test shards hold {ours.image_size}x"
                f"{ours.image_size} ({ours.resize}, {ours.interpolation}), so the baseline cannot be re-scored on "
                "them: to gate models of this preprocessing, promote one of them, saying why "
                '(`make promote ACCEPT="<why>"`)')  # fmt: skip
    return ""


def score_baseline(params: RegressionParams, baseline: ProductionModel, shard_dir: Path, scores_path: Path | None,
                   environment_record: Path | None, candidate: Scored,
                   recorded: dict[str, Any]) -> Scored | str:  # fmt: skip
    """The baseline model's scores on today's test split (reused when nothing they depend on changed), or why it
    cannot be scored on it. Its bytes are checked against baseline/model.json first, every time."""
    try:
        digest = baseline.verify()
    except ModelIntegrityError as exc:
        raise StageError(str(exc)) from None
    if digest == candidate.onnx_sha256:
        log.info("the baseline %s is the exported model itself: its test scores are the same", baseline.path)
        return candidate
    key = scoring_key(digest, shard_dir, params.batch_size, environment_record)
    reused = _reusable(scores_path, key)
    if reused is not None:
        log.info("test scores of the baseline %s reused from %s: the same ONNX bytes, test shards, code and "
                 "environment", baseline.path, scores_path)  # fmt: skip
        return Scored(digest, reused, key)
    try:
        model = baseline.load()
    except (ModelIntegrityError, ModelMetadataError) as exc:
        raise StageError(str(exc)) from None
    different = _unscorable(model, shard_dir, recorded, candidate.scores)
    if different:
        return different
    log.info("scoring the baseline %s on today's test split", baseline.path)
    scores = _score(model, shard_dir, params.batch_size)
    _keep(scores_path, key, scores)
    return Scored(digest, scores, key)
