"""Stage check_regression: exported ONNX (hash-verified) + test shards + baseline/ -> regression.json, .md.

The model that ships is scored through the serving path (tasks.release.inference) on the fixed test split
and compared with the promoted baseline under params.yaml's rules; the export's deferred gates
(INT8 vs fp32, recorded in export.json) are part of the same verdict. Exits 1 on any failed rule or
gate, and on a baseline scored on another test set (one `different test set` line), except inside
`dvc exp run`: there the verdict is recorded in reports/gate.json, a DVC metric that `dvc exp show`
lists, and the experiment is kept. With no baseline yet the baseline rules pass and say so.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from tasks.core.cli import stage_main
from tasks.core.environment import dvc_experiment
from tasks.core.errors import StageError
from tasks.core.io import atomic_file, read_json, write_json
from tasks.core.params import Params, RegressionParams
from tasks.core.paths import BASELINE_METRICS
from tasks.release.parity import Check
from tasks.release.production import baseline_sha256, load_baseline, load_verified_model
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
) -> Verdict:
    model = load_verified_model(onnx_path, export_report)
    try:
        metrics = score_split(model, shard_dir, "test", params.batch_size)
    except ValueError as exc:
        raise StageError(str(exc)) from None
    baseline = load_baseline(baseline_dir)
    verdict = compare(metrics, baseline, params.rules).with_gates(export_gates(export_report))
    baseline_path = baseline_dir / BASELINE_METRICS
    write_json(
        verdict_path,
        {
            **verdict.to_json(),
            "baseline": str(baseline_path),
            "baseline_sha256": baseline_sha256(baseline_dir),  # what make promote and commit-run check it against
            "model": {"path": str(onnx_path), "onnx_sha256": model.sha256},
            "metrics": metrics,
        },
    )
    write_json(gate_path, {"verdict": verdict.status, "passed": verdict.passed, "enforced": dvc_experiment() is None,
                           "summary": verdict.summary()})  # fmt: skip
    table = format_table(verdict)
    with atomic_file(table_path, "w") as handle:
        handle.write(f"# Regression check\n\n`{onnx_path}` (sha256 `{model.sha256}`), scored on the test split, "
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
