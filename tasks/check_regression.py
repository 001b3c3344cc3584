"""Stage check_regression: metrics.json vs baseline/metrics.json -> regression.json; exit 1 on regression."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from tasks.cli import stage_main
from tasks.io import read_json, write_json
from tasks.params import Params, RegressionParams
from tasks.regression import Verdict, compare, format_table

log = logging.getLogger(__name__)

BASELINE_METRICS = "metrics.json"


def run(params: RegressionParams, *, metrics_path: Path, baseline_dir: Path, verdict_path: Path) -> Verdict:
    baseline_path = baseline_dir / BASELINE_METRICS
    baseline = read_json(baseline_path) if baseline_path.is_file() else None
    verdict = compare(read_json(metrics_path), baseline, params.rules)
    write_json(verdict_path, {**verdict.to_json(), "baseline": str(baseline_path)})
    log.info("%s vs %s\n%s", metrics_path, baseline_path, format_table(verdict))
    return verdict


def _main(p: Params) -> None:
    verdict = run(
        p.regression,
        metrics_path=p.paths.reports / "metrics.json",
        baseline_dir=p.paths.baseline,
        verdict_path=p.paths.reports / "regression.json",
    )
    if not verdict.passed:
        failed = ", ".join(r.metric for r in verdict.results if not r.passed)
        print(f"[check_regression] REGRESSION: {failed} worse than the baseline", file=sys.stderr)
        sys.exit(1)


def main() -> None:
    stage_main("check_regression", _main)


if __name__ == "__main__":
    main()
