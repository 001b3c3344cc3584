"""Stage check_regression: exported ONNX (hash-verified) + test shards + baseline/ -> regression.json, .md.

The model that ships is scored through the serving path (tasks.inference) on the fixed test split
and compared with the promoted baseline under params.yaml's rules; exits 1 on any failed rule.
With no baseline yet it passes and says so.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from tasks.baseline import BASELINE_METRICS, load_baseline, load_verified_model
from tasks.cli import StageError, stage_main
from tasks.inference import score_split
from tasks.io import atomic_file, write_json
from tasks.params import Params, RegressionParams
from tasks.regression import Verdict, compare, format_table

log = logging.getLogger(__name__)


def run(
    params: RegressionParams,
    *,
    onnx_path: Path,
    export_report: Path,
    shard_dir: Path,
    baseline_dir: Path,
    verdict_path: Path,
    table_path: Path,
) -> Verdict:
    model = load_verified_model(onnx_path, export_report)
    try:
        metrics = score_split(model, shard_dir, "test", params.batch_size)
    except ValueError as exc:
        raise StageError(str(exc)) from None
    baseline = load_baseline(baseline_dir)
    verdict = compare(metrics, baseline, params.rules)
    baseline_path = baseline_dir / BASELINE_METRICS
    write_json(
        verdict_path,
        {
            **verdict.to_json(),
            "baseline": str(baseline_path),
            "model": {"path": str(onnx_path), "onnx_sha256": model.sha256},
            "metrics": metrics,
        },
    )
    table = format_table(verdict)
    with atomic_file(table_path, "w") as handle:
        handle.write(f"# Regression check\n\n`{onnx_path}` (sha256 `{model.sha256}`), scored on the test split, "
                     f"vs `{baseline_path}`\n\n{format_table(verdict, markdown=True)}\n")  # fmt: skip
    log.info("%s (accuracy %.4f on %d test images) vs %s\n%s", onnx_path, metrics["accuracy"],
             metrics["num_samples"], baseline_path, table)  # fmt: skip
    return verdict


def _main(p: Params) -> None:
    verdict = run(
        p.regression,
        onnx_path=p.paths.onnx,
        export_report=p.paths.reports / "export.json",
        shard_dir=p.paths.shards,
        baseline_dir=p.paths.baseline,
        verdict_path=p.paths.reports / "regression.json",
        table_path=p.paths.reports / "regression.md",
    )
    if not verdict.passed:
        names = ", ".join(dict.fromkeys(r.metric for r in verdict.failures))
        details = "\n".join(f"  {r.describe()}" for r in verdict.failures)
        print(f"[check_regression] REGRESSION: {names} failed against {p.paths.baseline}\n{details}", file=sys.stderr)
        sys.exit(1)


def main() -> None:
    stage_main("check_regression", _main)


if __name__ == "__main__":
    main()
