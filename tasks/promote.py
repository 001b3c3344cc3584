"""`python -m tasks.promote` (make promote): this run's metrics and model hashes become the baseline.

Only this explicit command moves the baseline; check_regression then compares every run with it.
"""

from __future__ import annotations

import shutil

from tasks.check_regression import BASELINE_METRICS
from tasks.io import sha256_file, write_json
from tasks.params import load_params


def main() -> None:
    params = load_params()
    metrics_path = params.paths.reports / "metrics.json"
    baseline = params.paths.baseline
    baseline.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(metrics_path, baseline / BASELINE_METRICS)
    write_json(
        baseline / "model.json",
        {
            "model_sha256": sha256_file(params.paths.model),
            "onnx_sha256": sha256_file(params.paths.onnx),
            "data_manifest_sha256": sha256_file(params.paths.shards / "manifest.json"),
        },
    )
    print(f"promoted {metrics_path} -> {baseline / BASELINE_METRICS}; commit {baseline}/ to keep it")


if __name__ == "__main__":
    main()
