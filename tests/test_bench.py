"""The benches run end to end on small inputs and report what they promise (numbers are not asserted: speed is
measured by running the bench, not by tests)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.folders import make_imagefolder
from tests.helpers.project import env_with_venv

ROOT = Path(__file__).resolve().parents[1]


def test_bench_data_reports_loading_and_preprocessing(tmp_path: Path) -> None:
    images = make_imagefolder(tmp_path / "images", classes=3, per_class=30)
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "bench.bench_data", "--images", str(images), "--size", "16", "--repeats", "2",
               "--json", str(out)]  # fmt: skip
    proc = subprocess.run(command, cwd=ROOT, env=env_with_venv(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ratio of the best runs" in proc.stdout and "random resized crop + flip" in proc.stdout
    report = json.loads(out.read_text())
    runs = report["preprocess_runs"]
    assert sorted(runs) == ["1", "2"] and all(len(r) == 2 for r in runs.values())
    for run in runs["1"] + runs["2"]:  # measured in the stage's own interpreter: its decoders did the work
        assert run["rate"] > 0 and run["decoder_cpu"] > 0 and run["main_cpu"] > 0
    for rates in report["loading_images_per_second"].values():
        assert rates["imagefolder"] > 0 and rates["shards"] > 0


def test_bench_drift_reports_false_alarms_detection_and_cost(tmp_path: Path) -> None:
    out = tmp_path / "drift.json"
    command = [sys.executable, "bench/bench_drift.py", "--classes", "10", "--windows", "200", "--trials", "20",
               "--json", str(out)]  # fmt: skip
    proc = subprocess.run(command, cwd=ROOT, env=env_with_venv(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "false alarms (95% CI)" in proc.stdout and "detect +20pt" in proc.stdout
    (row,) = json.loads(out.read_text())
    assert row["classes"] == 10 and row["window"] == 200 and row["trials"] == 20
    assert 0 <= row["false_alarms"] <= 1 and 0 <= row["detection_20_points"] <= 1 and row["us_per_prediction"] > 0
    assert set(row["thresholds"]) == {"class_mix_psi", "top1_psi", "margin_psi"}


@pytest.mark.slow  # about 25 s: exports an untrained resnet18 and starts a uvicorn
def test_bench_serving_prints_the_table_the_server_line_and_the_drift_cost() -> None:
    """bench_serving with its default model (an untrained resnet18 in a temporary folder), one configuration at
    c=8: the table, the server's line and the drift bookkeeping's cost, which is timed on that model (it was once
    loaded after its folder was deleted, and the bench died on its last line)."""
    command = [sys.executable, "bench/bench_serving.py", "--requests", "16", "--concurrency", "8",
               "--config", "one:1,1,1", "--size", "32"]  # fmt: skip
    proc = subprocess.run(command, cwd=ROOT, env=env_with_venv(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "one (1x1t, batch<=1) multipart c=8" in out and "one (1x1t, batch<=1) raw c=8" in out, out
    assert "bare, 1 thread, one at a time" in out and "one: ready" in out and "raw c=8:" in out, out
    assert re.search(r"drift bookkeeping: [0-9.]+ us per prediction, [0-9.]+% of a raw c=8 request's", out), out


def test_gpu_check_says_it_is_skipped_without_cuda_and_exits_0() -> None:
    """make gpu-check on a machine without CUDA: one line naming why, exit 0 (on a GPU it trains: make gpu-check)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: run make gpu-check, the whole check")
    proc = subprocess.run([sys.executable, "bench/gpu_check.py"], cwd=ROOT, env=env_with_venv(), capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("gpu-check skipped: no CUDA device (torch ") and len(proc.stdout.splitlines()) == 1
