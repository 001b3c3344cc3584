"""`python -m tasks.tools.promote` (make promote): this run's exported model becomes the regression baseline.

reports/regression.json (the ONNX model's metrics on the test split) + the hash-verified ONNX + the test
split's manifest -> baseline/metrics.json, baseline/model.json (hashes, provenance), baseline/model.onnx and
baseline/test_set.json (each promoted test image's content sha256 and class, so that check_regression can say
which of a later test split's images are new), baseline/model.pt (the PyTorch model the ONNX came from, what
`make warm-start` grows the next model from) and baseline/decision.json (who, when, the gate's verdict, and
why it was set aside: tasks/tools/decision.py), each tracked by DVC (`dvc add`). Only this explicit command
moves the baseline; the gate then runs against it (`dvc repro --single-item check_regression`), so dvc.lock
records it; commit baseline/ afterwards. A failed or incomparable gate (a regression, a `different
test set`) needs a reason, `--accept "<why>"` (make promote ACCEPT="<why>"); a model trained with test hooks is
refused whatever the reason.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.core.cli import stage_main
from tasks.core.errors import StageError
from tasks.core.io import read_json, sha256_file, write_json
from tasks.core.params import Params
from tasks.core.paths import BASELINE_DECISION, BASELINE_METRICS, BASELINE_MODEL, BASELINE_ONNX, BASELINE_WEIGHTS
from tasks.images.image_set import split_sha256
from tasks.images.shards import MANIFEST, load_manifest
from tasks.release import tracking
from tasks.release.gate import hooks_refusal, promote_refusal
from tasks.release.production import BASELINE_TEST_SET, load_verified_model
from tasks.tools.decision import decision_record, registry_tags
from tasks.tools.record import GATE_STAGE, record_refusal

log = logging.getLogger(__name__)
ACCEPT_ENV = "IMAGEPIPE_ACCEPT"  # how make promote hands over ACCEPT= (its quotes and `$` as typed)


@dataclass(frozen=True)
class PromoteResult:
    files: tuple[Path, ...]
    onnx_sha256: str
    accuracy: float
    decision: dict[str, Any]


def run(
    *,
    onnx_path: Path,
    model_path: Path,
    export_report: Path,
    verdict_path: Path,
    shard_dir: Path,
    baseline_dir: Path,
    accept: str | None = None,
    track_with_dvc: bool = True,
) -> PromoteResult:
    """Check that the metrics belong to this exact model, then write the baseline (and `dvc add` it). `accept`:
    a person's reason to promote over a failed or incomparable gate, recorded in baseline/decision.json."""
    model = load_verified_model(onnx_path, export_report)
    if not verdict_path.is_file():
        raise StageError(f"{verdict_path}: missing; run `dvc repro` so the model is scored before promoting it")
    verdict = read_json(verdict_path)
    scored = verdict.get("model", {}).get("onnx_sha256")
    if scored != model.sha256:
        raise StageError(
            f"{verdict_path} scored a model with sha256 {scored}, but {onnx_path} is {model.sha256}; "
            "run `dvc repro` first"
        )
    refusal = promote_refusal(verdict, verdict_path, accepted=bool(accept)) or hooks_refusal(
        model.metadata.get("provenance.test_hooks"), str(onnx_path)
    )
    if refusal:
        raise StageError(f"refused: {refusal}")
    if sha256_file(model_path) != model.metadata.get("model_sha256"):
        raise StageError(f"{model_path} is not the model {onnx_path} was exported from; run `dvc repro` first")
    metrics = verdict["metrics"]
    test_set = promoted_test_set(shard_dir, metrics.get("test_set_sha256"), verdict_path)
    record = {
        "onnx_sha256": model.sha256,
        "model_sha256": model.metadata["model_sha256"],
        "data_manifest_sha256": sha256_file(shard_dir / MANIFEST),
        "test_set_sha256": metrics.get("test_set_sha256"),
        "class_names": list(model.class_names),
        **{k: v for k, v in sorted(model.metadata.items()) if k.endswith("sha256") or k.startswith("provenance.")},
    }
    decision = decision_record(verdict, model.sha256, accept)
    baseline_dir.mkdir(parents=True, exist_ok=True)
    files = (baseline_dir / BASELINE_METRICS, baseline_dir / BASELINE_MODEL, baseline_dir / BASELINE_ONNX,
             baseline_dir / BASELINE_TEST_SET, baseline_dir / BASELINE_DECISION,
             baseline_dir / BASELINE_WEIGHTS)  # fmt: skip
    staged = [path.with_name(f".{path.name}.tmp-{os.getpid()}") for path in files]
    try:  # everything written beside the baseline first, then renamed in: never half a baseline
        write_json(staged[0], metrics)
        write_json(staged[1], record)
        shutil.copyfile(onnx_path, staged[2])
        if sha256_file(staged[2]) != model.sha256:
            raise StageError(f"{onnx_path} changed while it was being copied to {files[2]}; promote again")
        write_json(staged[3], test_set)
        write_json(staged[4], decision)
        shutil.copyfile(model_path, staged[5])  # make warm-start's parent (tasks/tools/warm_start.py)
        if sha256_file(staged[5]) != record["model_sha256"]:
            raise StageError(f"{model_path} changed while it was being copied to {files[5]}; promote again")
        for tmp, final in zip(staged, files, strict=True):
            os.replace(tmp, final)
    finally:
        for tmp in staged:
            tmp.unlink(missing_ok=True)
    if track_with_dvc:
        proc = subprocess.run([sys.executable, "-m", "dvc", "add", *map(str, files)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise StageError(f"dvc add {' '.join(map(str, files))} failed:\n{proc.stdout}{proc.stderr}")
    return PromoteResult(files, model.sha256, float(metrics["accuracy"]), decision)


def promoted_test_set(shard_dir: Path, scored_sha256: object, verdict_path: Path) -> dict[str, Any]:
    """baseline/test_set.json: the test split the verdict scored, each image's content sha256 -> its class."""
    manifest = load_manifest(shard_dir)
    digest = split_sha256(manifest, "test")
    if digest != scored_sha256:
        raise StageError(f"{verdict_path} scored test set sha256 {scored_sha256}, but {shard_dir} now holds "
                         f"{digest}; run `dvc repro` first")  # fmt: skip
    names = manifest["class_names"]
    images = {e["sha256"]: names[e["label"]] for e in manifest["files"] if e["split"] == "test"}
    return {"test_set_sha256": digest, "class_names": names, "images": images}


def _main(params: Params, accept: str | None = None, *, regate: bool = True) -> None:
    paths = params.paths
    load_verified_model(paths.onnx, paths.export_report)  # altered bytes are named as such, before anything else
    # before anything is written: a refused promote leaves baseline/ as it was
    refusal = record_refusal(paths, accepting=bool(accept))
    if refusal:
        raise StageError(f"refused: {refusal}")
    result = run(
        onnx_path=paths.onnx,
        model_path=paths.model,
        export_report=paths.export_report,
        verdict_path=paths.regression_json,
        shard_dir=paths.shards,
        baseline_dir=paths.baseline,
        accept=accept,
    )
    decision = result.decision
    # mirrors baseline/, the decision on the registry version
    tracking.register_production(params, paths.baseline / BASELINE_ONNX, result.onnx_sha256, registry_tags(decision))
    if decision["set_aside"]:
        log.warning("accepted by %s: %r; the gate's verdict '%s' set aside (%s); recorded in %s",
                    decision["by"], accept, decision["set_aside"]["verdict"], decision["set_aside"]["summary"],
                    paths.baseline / BASELINE_DECISION)  # fmt: skip
    log.info("baseline <- %s (sha256 %s..., test accuracy %.4f); tracked by DVC. The gate runs against it now, so "
             "dvc.lock records it", paths.onnx, result.onnx_sha256[:16], result.accuracy)  # fmt: skip
    if regate:
        gate = subprocess.run([sys.executable, "-m", "dvc", "repro", "--single-item", GATE_STAGE], check=False)
        if gate.returncode != 0:
            raise StageError(f"the gate against the new baseline failed (`dvc repro --single-item {GATE_STAGE}`, exit "
                             f"{gate.returncode}); {paths.baseline}/ is promoted: run make run")  # fmt: skip
    log.info("to keep it: make commit-run MSG='promote baseline'   # commits %s, dvc.lock, reports; `dvc push` "
             "shares the files", paths.baseline)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tasks.tools.promote", description=__doc__.splitlines()[0])
    parser.add_argument("--accept", metavar="WHY", help="promote over a failed or incomparable gate, for this reason")
    parser.add_argument("--accept-from-env", action="store_true",
                        help=f"the reason from ${ACCEPT_ENV} (make promote ACCEPT=...; empty: none)")  # fmt: skip
    args = parser.parse_args()
    if args.accept_from_env:
        args.accept = os.environ.get(ACCEPT_ENV) or None
    accept = (args.accept or "").strip() or None
    if args.accept is not None and accept is None:
        print('[promote] error: ACCEPT is empty: say why the gate\'s verdict is set aside, make promote ACCEPT="<why>"',
              file=sys.stderr)  # fmt: skip
        sys.exit(2)
    stage_main("promote", lambda params: _main(params, accept))


if __name__ == "__main__":
    main()
