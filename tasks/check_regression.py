"""Stage check_regression: exported ONNX (hash-verified) + test shards + baseline/ -> regression.json, .md.

The model that ships is scored through the serving path (tasks.release.inference) on the fixed test split
and compared with the promoted baseline under params.yaml's rules; the export's deferred gates
(INT8 vs fp32, recorded in export.json) are part of the same verdict. Exits 1 on any failed rule or
gate, and on a baseline scored on another test set (one `different test set` line), except inside
`dvc exp run`: there the verdict is recorded in reports/gate.json, a DVC metric that `dvc exp show`
lists, and the experiment is kept. With no baseline yet the baseline rules pass and say so.

The stage is `always_changed` in dvc.yaml: whether the gate is enforced is decided when it runs, so
`dvc repro` and `dvc repro -s check_regression` after an experiment enforce the verdict the experiment
only recorded, and no DVC skip or run cache stands in for the gate. Scoring the test split is the
costly part: the scores are kept in `<paths.runs>/check_regression/scores.json` (unversioned, like the
checkpoints: DVC removes a stage's outputs before it runs) and reused when they were made from the same
ONNX bytes, test shards, batch size, stage code and environment record (`scoring_key`); the comparison
with the baseline and the export gates is made again every time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

from tasks.core.cli import stage_main
from tasks.core.environment import dvc_experiment, stage_code
from tasks.core.errors import StageError
from tasks.core.io import atomic_file, read_json, sha256_file, write_json
from tasks.core.params import Params, RegressionParams
from tasks.core.paths import BASELINE_METRICS
from tasks.images.shards import MANIFEST
from tasks.release.parity import Check
from tasks.release.production import baseline_sha256, load_baseline, load_verified_model, recorded_onnx_sha256
from tasks.release.scoring import score_split
from tasks.release.verdict import Verdict, compare, format_table

log = logging.getLogger(__name__)


def export_gates(export_report: Path) -> tuple[Check, ...]:
    """The gates export measured but left to this verdict (onnx_int8.gates in export.json), judged
    again here from value, operator and limit: a recorded `passed` is not taken on trust."""
    raw = read_json(export_report).get("onnx_int8", {}).get("gates", [])
    gates = []
    for i, gate in enumerate(raw):
        ok = isinstance(gate, dict) and all(isinstance(gate.get(k), str) for k in ("name", "param"))
        ok = ok and gate.get("op") in (">=", "<=")
        ok = ok and all(isinstance(gate.get(k), int | float) and not isinstance(gate.get(k), bool)
                        for k in ("value", "limit"))  # fmt: skip
        if not ok:
            raise StageError(f"{export_report}: onnx_int8.gates.{i} is not a gate record (got {gate!r})")
        gates.append(Check(gate["name"], float(gate["value"]), gate["op"], float(gate["limit"]), gate["param"]))
    return tuple(gates)


def scoring_key(onnx_sha256: str, shard_dir: Path, batch_size: int, environment_record: Path | None) -> str:
    """What the test split's scores depend on: the ONNX bytes, the shards (their manifest holds every shard's
    sha256), the batch size, this stage's code as dvc.yaml lists it, and its environment record (onnxruntime's
    version, the CPU's flags, the cores)."""
    record = environment_record.read_bytes() if environment_record and environment_record.is_file() else b""
    key = {"onnx": onnx_sha256, "manifest": sha256_file(shard_dir / MANIFEST), "batch_size": batch_size,
           "code": stage_code("check_regression", Path(__file__).resolve().parents[1]),
           "environment": hashlib.sha256(record).hexdigest()}  # fmt: skip
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _reusable(scores_path: Path, key: str) -> dict[str, Any] | None:
    """The kept scores when they were made from exactly these inputs, else None."""
    try:
        kept = read_json(scores_path)
    except (OSError, ValueError):
        return None
    if not isinstance(kept, dict) or kept.get("key") != key or not isinstance(kept.get("metrics"), dict):
        return None
    return kept["metrics"]


def _score(params: RegressionParams, onnx_path: Path, export_report: Path, shard_dir: Path,
           scores_path: Path | None, environment_record: Path | None) -> tuple[str, dict[str, Any], str]:  # fmt: skip
    """(the ONNX file's sha256, its test metrics, the scoring key): reused when nothing they depend on changed,
    else scored through the serving path. Either way the file's bytes are checked against export.json first."""
    onnx_sha256 = sha256_file(onnx_path) if onnx_path.is_file() else ""
    key = scoring_key(onnx_sha256, shard_dir, params.batch_size, environment_record)
    if scores_path is not None and onnx_sha256 == recorded_onnx_sha256(export_report):
        reused = _reusable(scores_path, key)
        if reused is not None:
            log.info("test scores of %s reused from %s: the same ONNX bytes, test shards, code and environment",
                     onnx_path, scores_path)  # fmt: skip
            return onnx_sha256, reused, key
    model = load_verified_model(onnx_path, export_report)  # refuses bytes other than the recorded ones
    try:
        metrics = score_split(model, shard_dir, "test", params.batch_size)
    except ValueError as exc:
        raise StageError(str(exc)) from None
    if scores_path is not None:
        write_json(scores_path, {"key": key, "metrics": metrics})
    return model.sha256, metrics, key


def run(
    params: RegressionParams,
    *,
    onnx_path: Path,
    export_report: Path,
    shard_dir: Path,
    baseline_dir: Path,
    verdict_path: Path,
    table_path: Path,
    gate_path: Path,
    scores_path: Path | None = None,
    environment_record: Path | None = None,
) -> Verdict:
    onnx_sha256, metrics, key = _score(params, onnx_path, export_report, shard_dir, scores_path, environment_record)
    baseline = load_baseline(baseline_dir)
    verdict = compare(metrics, baseline, params.rules).with_gates(export_gates(export_report))
    baseline_path = baseline_dir / BASELINE_METRICS
    write_json(
        verdict_path,
        {
            **verdict.to_json(),
            "baseline": str(baseline_path),
            "baseline_sha256": baseline_sha256(baseline_dir),  # what make promote and commit-run check it against
            "model": {"path": str(onnx_path), "onnx_sha256": onnx_sha256},
            "metrics": metrics,
            "scored": {"key": key},  # the inputs the metrics were scored from (scoring_key)
        },
    )
    write_json(gate_path, {"verdict": verdict.status, "passed": verdict.passed, "enforced": dvc_experiment() is None,
                           "summary": verdict.summary()})  # fmt: skip
    table = format_table(verdict)
    with atomic_file(table_path, "w") as handle:
        handle.write(f"# Regression check\n\n`{onnx_path}` (sha256 `{onnx_sha256}`), scored on the test split, "
                     f"vs `{baseline_path}`\n\n{format_table(verdict, markdown=True)}\n")  # fmt: skip
    log.info("%s (accuracy %.4f on %d test images) vs %s\n%s", onnx_path, metrics["accuracy"],
             metrics["num_samples"], baseline_path, table)  # fmt: skip
    return verdict


def _main(p: Params) -> int:
    verdict = run(
        p.regression,
        onnx_path=p.paths.onnx,
        export_report=p.paths.export_report,
        shard_dir=p.paths.shards,
        baseline_dir=p.paths.baseline,
        verdict_path=p.paths.regression_json,
        table_path=p.paths.regression_md,
        gate_path=p.paths.gate,
        scores_path=p.paths.runs / "check_regression" / "scores.json",
        environment_record=p.paths.environment / "check_regression.json",
    )
    if verdict.passed:
        log.info("%s", verdict.summary())
        return 0
    details = "".join(f"\n  {r.describe()}" for r in verdict.failures) if not verdict.mismatch else ""
    experiment = dvc_experiment()
    if experiment:
        # An experiment explores: a failed stage would make `dvc exp run` keep nothing, metrics included.
        log.warning("%s%s\nexperiment %s: verdict '%s' recorded in %s (dvc exp show), not enforced; `dvc repro`, "
                    "make run, train-flow/prod and the nightly enforce it", verdict.summary(), details, experiment,
                    verdict.status, p.paths.gate)  # fmt: skip
        return 0
    print(f"[check_regression] {verdict.summary()}{details}", file=sys.stderr)
    return 1


def main() -> None:
    stage_main("check_regression", _main)


if __name__ == "__main__":
    main()
