"""Week two as one test (issue 38): a model served, traffic that drifts, the nightly says Drift, the review folder
relabelled and taken in, a retrained model gated on the grown test set, promoted and reloaded, and test-like
traffic reading `ok` again: the nightly is green.

Everything is real: a git + DVC copy of the project driven by the Makefile (`make add-data`, `make run`,
`make promote`), uvicorn from the torch-free serving venv, regression-flow in-process on the session's test
Prefect server. The pieces have their own short tests: tests/stages/test_add_data.py (INTO=, the review folder),
tests/stages/test_check_regression.py (the baseline re-scored), tests/serving/test_drift_server.py (drift,
/reload), tests/flows/test_nightly_drift.py (the nightly's states).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tasks.core.params import load_params
from tests.helpers.folders import make_imagefolder
from tests.helpers.project import ROOT, commit, env_with_venv, make_command, make_project
from tests.helpers.serving import post_reload, running_server

NAME = "colours"
DRIFTED = "class_1"  # the one class the drifted traffic holds
SENT = 80  # drifted images: at test_fraction 0.2 about 16 of them land in the test split once taken in
# The server's drift window, in params.yaml before the first run: export calibrates the thresholds for it.
DRIFT = {"window": 40, "min_predictions": 20, "false_alarm_rate": 0.01}
PARAMS = {
    "train": {"epochs": 6},  # colour classes: learnt in a few tiny epochs
    "export": {"formats": ["onnx"]},  # the served model only: INT8 and TorchScript have their own tests
    "serve": {"drift": DRIFT},
}


def make(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(make_command(*args), cwd=repo, env=env_with_venv(), capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, f"make {' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def predict(url: str, images: list[Path]) -> list[dict[str, Any]]:
    """Each image POSTed to /predict as a client sends it (raw body); the predictions."""
    out = []
    with httpx.Client(timeout=30) as client:
        for path in images:
            response = client.post(f"{url}/predict", content=path.read_bytes(),
                                   headers={"content-type": "application/octet-stream"})  # fmt: skip
            assert response.status_code == 200, response.text
            out.append(response.json()["prediction"])
    return out


def relabel(review: Path, truth: dict[str, str]) -> int:
    """What a person does with the review folder: each image into the folder of its true class (known here by its
    bytes: `truth` maps sha256 -> class); its .json sidecar left where the server wrote it. Returns how many moved."""
    moved = 0
    for image in sorted(p for p in review.rglob("*") if p.is_file() and p.suffix != ".json"):
        true_class = truth[hashlib.sha256(image.read_bytes()).hexdigest()]
        if image.parent.name != true_class:
            (review / true_class).mkdir(exist_ok=True)
            image.rename(review / true_class / image.name)
            moved += 1
    return moved


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []


def report(repo: Path, name: str) -> dict[str, Any]:
    return json.loads((repo / "reports" / name).read_text())


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow  # about 2 min on 2 cores: two tiny runs, two promotions, a server, two nightly runs
def test_drift_relabel_grow_retrain_promote_reload(tmp_path: Path, prefect_api: None) -> None:
    from flows.regression_flow import regression_flow

    # 1. A user's folder of three colour classes as a DVC-tracked dataset; a run; the baseline.
    repo = make_project(tmp_path / "repo", PARAMS)
    shutil.copy2(ROOT / ".gitignore", repo / ".gitignore")  # runs/ and data/review/ stay out of git
    source = make_imagefolder(tmp_path / "images", classes=3, per_class=40, seed=0)
    make(repo, "add-data", f"SRC={source}", f"NAME={NAME}")
    dataset = repo / "data" / "raw" / NAME
    before = len(files_under(dataset))
    make(repo, "run")
    make(repo, "promote")
    assert report(repo, "gate.json")["verdict"] == "pass"
    commit(repo, "colours: first run, promoted")
    first_sha = sha256_of(repo / "baseline" / "model.onnx")
    first_test = report(repo, "regression.json")["metrics"]["num_samples"]

    # 2. The promoted model served, with the drift window export calibrated for. Every input is kept for review:
    # the model is sure of colours (top-1 0.99998 at most here), so any low_confidence under 1 would keep none.
    params = load_params(repo / "params.yaml")
    review = repo / params.serve.review_dir
    with running_server(repo, review, low_confidence=1.0, drift=params.serve.drift) as (url, _):
        assert httpx.get(f"{url}/ready").json()["model"]["sha256"] == first_sha

        # 3. Traffic of one class: new images of it (another drawing), in no split. The nightly ends in Drift.
        traffic = make_imagefolder(tmp_path / "traffic", classes=3, per_class=SENT, seed=7)
        drifted = sorted((traffic / DRIFTED).iterdir())
        truth = {sha256_of(path): DRIFTED for path in drifted}
        assert len(truth) == SENT
        predictions = predict(url, drifted)
        drift = httpx.get(f"{url}/drift").json()
        assert drift["verdict"] == "drift", drift
        assert drift["window"]["filled"] == DRIFT["window"] and drift["moved_most"][0]["class"] == DRIFTED
        sources = {stat["source"] for stat in drift["statistics"].values()}
        windows = f"windows of {DRIFT['min_predictions']}/{DRIFT['window']}"
        assert all(s.startswith("calibrated at export") and windows in s for s in sources), sources
        assert drift["statistics"]["class_mix_psi"]["exceeded"], drift["statistics"]
        with contextlib.chdir(repo):
            night = regression_flow(server=url, return_state=True)
        assert night.is_failed() and night.name == "Drift", (night.name, night.message)
        assert "the regression check passed" in night.message and f"moved most: {DRIFTED} +" in night.message
        assert sorted(sha256_of(p) for p in files_under(review) if p.suffix != ".json") == sorted(truth)
        assert len([p for p in files_under(review) if p.suffix == ".json"]) == SENT

        # 4. Relabelled by a person; the model's wrong guesses are the ones that move.
        wrong = sum(p["top_k"][0]["label"] != DRIFTED for p in predictions)
        assert relabel(review, truth) == wrong
        assert {p.parent.name for p in files_under(review) if p.suffix != ".json"} == {DRIFTED}

        # 5. Taken in: the dataset grows, data.source stays, the review folder gives up what was taken.
        make(repo, "add-data", f"SRC={params.serve.review_dir}", f"INTO={NAME}")
        assert load_params(repo / "params.yaml").data.source == Path("data/raw") / NAME
        assert len(files_under(dataset)) == before + SENT
        assert {sha256_of(p) for p in files_under(dataset / DRIFTED)} >= set(truth)
        assert files_under(review) == []
        merge = yaml.safe_load((repo / "data" / "raw" / f"{NAME}.dvc").read_text())["meta"]["merges"][-1]
        assert merge["added"] == SENT and merge["from_review"] is True
        new_in_test = merge["splits"]["test"]
        assert new_in_test > 0

        # 6. Retrained on the grown data; the gate re-scores the baseline on today's test set.
        make(repo, "run")
        gate = report(repo, "gate.json")
        assert gate["verdict"] == "pass", gate
        rescored = re.search(r"baseline re-scored on today's test set: (\d+) images, (\d+) new", gate["summary"])
        assert rescored, gate["summary"]
        assert (int(rescored[1]), int(rescored[2])) == (first_test + new_in_test, new_in_test)

        # 7. Promoted, and the running server told to serve it.
        make(repo, "promote")
        second_sha = sha256_of(repo / "baseline" / "model.onnx")
        assert second_sha != first_sha
        reloaded = post_reload(repo, url)
        assert reloaded.status_code == 200 and reloaded.json()["status"] == "reloaded", reloaded.text
        assert reloaded.json()["previous"]["sha256"] == first_sha
        assert httpx.get(f"{url}/ready").json()["model"]["sha256"] == second_sha

        # 8. Traffic like the new test split (its own images) reads ok against the new model's reference, and the
        # nightly is green again.
        manifest = json.loads((repo / params.paths.shards / "manifest.json").read_text())
        test_images = [dataset / f["path"] for f in manifest["files"] if f["split"] == "test"]
        assert len(test_images) >= DRIFT["min_predictions"]
        predict(url, test_images)
        drift = httpx.get(f"{url}/drift").json()
        assert drift["verdict"] == "ok", drift
        assert drift["model"]["sha256"] == second_sha
        with contextlib.chdir(repo):
            night = regression_flow(server=url, return_state=True)
        assert night.is_completed(), (night.name, night.message)
        assert night.result()["drift"]["verdict"] == "ok"
