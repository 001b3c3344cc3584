"""The nightly check against a drifting server, the way a user runs it: a real Prefect server and worker
(scripts/prefect.sh), train-flow/prod, promote, a real uvicorn on the promoted model fed one class, then
`prefect deployment run regression-flow/nightly -p server=...`: the run ends in Drift, its artifacts are
there, and the drift automation's notification reaches a webhook (a real HTTP server in this test).

The fast tests run regression-flow in-process on the session's test Prefect server, against a real HTTP
server answering /drift with a report of the server's shape (or 503), in a project of tiny shards and a
hand-made promoted ONNX model: which state each night ends in, with and without a baseline.
"""

from __future__ import annotations

import http.server
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
import numpy as np
import onnx
import pytest

from tasks.core.io import sha256_file, write_json
from tasks.core.params import DriftParams
from tests.helpers.drift import DriftServer, nightly
from tests.helpers.export import make_shards
from tests.helpers.prefect import VENV, api_artifacts, free_port, production_project
from tests.helpers.project import env_with_venv, write_params
from tests.helpers.serving import running_server

CALIBRATED = "calibrated at export: false-alarm rate 0.01 per window"


def drift_report(verdict: str) -> dict[str, Any]:
    """A /drift report of the server's shape (tasks/release/drift.py): class_mix_psi over its threshold when
    `verdict` is drift. The nightly reads only its verdict; the statistics go to the table, figure and message."""
    fired = verdict == "drift"
    statistics = {
        "class_mix_psi": {"value": 0.91 if fired else 0.01, "threshold": 0.3, "exceeded": fired, "source": CALIBRATED},
        "top1_psi": {"value": 0.02, "threshold": 0.3, "exceeded": False, "source": CALIBRATED},
        "margin_psi": {"value": 0.02, "threshold": 0.25, "exceeded": False},  # a server that names no source
    }
    shares = [0.9, 0.05, 0.05] if fired else [0.34, 0.33, 0.33]
    classes = [{"class": f"class_{i}", "observed": s, "expected": 0.33, "contribution": 0.3 if fired else 0.0}
               for i, s in enumerate(shares)]  # fmt: skip
    deciles = {"edges": [0.1 * i for i in range(1, 10)], "observed": [2] * 10, "expected": [6] * 10}
    return {"verdict": verdict, "window": {"size": 20, "filled": 20, "min_predictions": 10},
            "reference": {"split": "test", "num_samples": 60}, "statistics": statistics, "classes": classes,
            "moved_most": [{"class": "class_0", "change": 0.57 if fired else 0.01}], "top1": deciles,
            "margin": deciles, "scope": "worker 1",
            "review": {"dir": "data/review", "saved": 0, "max_files": 10}}  # fmt: skip


def tiny_onnx(path: Path, spec: dict[str, Any]) -> None:
    """A promotable ONNX model made by hand (mean colour -> logits) with the preprocessing spec in its metadata:
    what the nightly scores, without training or exporting one."""
    from onnx import TensorProto, helper, numpy_helper

    classes, size = len(spec["class_names"]), spec["image_size"]
    weights = np.random.default_rng(0).normal(size=(3, classes)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("GlobalAveragePool", ["x"], ["pooled"]), helper.make_node("Flatten", ["pooled"], ["flat"]),
         helper.make_node("MatMul", ["flat", "w"], ["logits"])],
        "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", classes])],
        [numpy_helper.from_array(weights, "w")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    helper.set_model_props(model, {"preprocess_spec": json.dumps(spec)})
    onnx.save(model, str(path))


@pytest.fixture(scope="module")
def promoted_project(prefect_api: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """params.yaml, tiny test shards and a promoted baseline (model, its hash, its own metrics): a nightly
    run on it passes its regression check in about a second."""
    from tasks.images.shards import load_manifest
    from tasks.release.inference import OnnxModel
    from tasks.release.scoring import score_split

    repo = tmp_path_factory.mktemp("nightly")
    write_params(repo, {})
    shards = make_shards(repo / "data", per_class=10)
    (repo / "baseline").mkdir()
    onnx_path = repo / "baseline" / "model.onnx"
    tiny_onnx(onnx_path, load_manifest(shards)["spec"])
    write_json(repo / "baseline" / "model.json", {"onnx_sha256": sha256_file(onnx_path)})
    write_json(repo / "baseline" / "metrics.json", score_split(OnnxModel.load(onnx_path), shards))
    return repo


def trigger_fires_on(state: Any) -> bool:
    """Whether the drift automation's trigger, as the Prefect server evaluates it, expects the event a flow run
    emits on entering `state` (prefect.flow-run.<state name>)."""
    from prefect.server.events.schemas.automations import EventTrigger as ServerTrigger

    from flows.automations import drift_automation

    trigger = drift_automation(uuid4()).trigger
    return ServerTrigger.model_validate(trigger.model_dump()).expects(f"prefect.flow-run.{state.name}")


@pytest.mark.slow  # the default suite's budget (issue 59 item 4): make test-slow runs it
def test_drift_without_a_baseline_ends_in_drift(drift_server: DriftServer, tmp_path: Path, prefect_api: None) -> None:
    """The shipped state has no baseline: drift must still end the night in Drift, which the automation reacts
    to; the table and the message name where each threshold comes from when the server says."""
    from flows.drift import TABLE_KEY

    write_params(tmp_path, {})
    drift_server.report = drift_report("drift")
    state = nightly(tmp_path, drift_server.url)
    assert state.is_failed() and state.name == "Drift", (state.name, state.message)
    assert trigger_fires_on(state)
    assert f"class_mix_psi 0.910 > 0.3 ({CALIBRATED})" in state.message, state.message
    assert "no baseline yet" in state.message and "make promote" in state.message
    data = api_artifacts(state.state_details.flow_run_id)[TABLE_KEY].data
    rows = {row["what"]: row for row in (json.loads(data) if isinstance(data, str) else data)}
    assert rows["class_mix_psi"]["source"] == CALIBRATED and rows["margin_psi"]["source"] is None

    drift_server.report = drift_report("ok")  # no drift and no baseline: as before, a plain Failed
    state = nightly(tmp_path, drift_server.url)
    assert state.is_failed() and state.name == "Failed" and state.message.startswith("no baseline yet")
    assert not trigger_fires_on(state)


def test_an_unreadable_server_needs_attention_on_the_kth_night_in_a_row(
    promoted_project: Path, drift_server: DriftServer, prefect_api: None
) -> None:
    """regression.drift_unreadable_nights (3): Completed on the first two nights the server answers 503, DriftUnread
    on the third; nights without `server` or with another server count neither way; a read night resets."""
    url = drift_server.url
    other = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    nights = [nightly(promoted_project, url), nightly(promoted_project), nightly(promoted_project, other),
              nightly(promoted_project, url)]  # fmt: skip
    assert all(night.is_completed() for night in nights), [(n.name, n.message) for n in nights]
    third = nightly(promoted_project, url)
    assert third.is_failed() and third.name == "DriftUnread", (third.name, third.message)
    assert trigger_fires_on(third)
    assert f"drift of {url} not read on 3 run(s) in a row" in third.message and "503" in third.message
    assert "the regression check passed" in third.message

    drift_server.report = drift_report("ok")
    assert nightly(promoted_project, url).is_completed()
    drift_server.report = None
    again = nightly(promoted_project, url)
    assert again.is_completed(), (again.name, again.message)  # one unread night since the read one


def test_a_server_unreadable_from_the_first_night_with_no_baseline(
    drift_server: DriftServer, tmp_path: Path, prefect_api: None
) -> None:
    """drift_unreadable_nights 1, no baseline: the first unread night ends in DriftUnread, the baseline's absence
    in its message."""
    write_params(tmp_path, {"regression": {"drift_unreadable_nights": 1}})
    state = nightly(tmp_path, drift_server.url)
    assert state.is_failed() and state.name == "DriftUnread", (state.name, state.message)
    assert "not read on 1 run(s) in a row" in state.message and "no baseline yet" in state.message


@pytest.fixture
def webhook() -> Iterator[tuple[str, list[bytes]]]:
    received: list[bytes] = []

    class Hook(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the handler's protocol
            received.append(self.rfile.read(int(self.headers.get("content-length", 0))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/hook", received
    finally:
        server.shutdown()


def test_the_nightly_scores_the_promoted_test_set_after_the_test_split_grew(tmp_path: Path, prefect_api: None) -> None:
    """Images that joined the test split after the promotion (make add-data INTO=...) do not turn the nightly into
    `different test set`: it scores the production model on the promoted test images (baseline/test_set.json),
    the set its promoted metrics were measured on, and the verdict compares like with like."""
    from tasks.images.shards import load_manifest
    from tasks.release.inference import OnnxModel
    from tasks.release.scoring import score_promoted_set, score_split, split_images

    write_params(tmp_path, {})
    shards = make_shards(tmp_path / "data", per_class=20)
    manifest = load_manifest(shards)
    (tmp_path / "baseline").mkdir()
    onnx_path = tmp_path / "baseline" / "model.onnx"
    tiny_onnx(onnx_path, manifest["spec"])
    write_json(tmp_path / "baseline" / "model.json", {"onnx_sha256": sha256_file(onnx_path)})
    test_images = split_images(shards)
    classes = {e["sha256"]: manifest["class_names"][e["label"]] for e in manifest["files"] if e["split"] == "test"}
    promoted = {digest: classes[digest] for digest in test_images[: len(test_images) * 2 // 3]}  # a third joined since
    model = OnnxModel.load(onnx_path)
    at_promotion = score_promoted_set(model, shards, promoted)
    assert at_promotion["num_samples"] == len(promoted) < len(test_images)
    assert at_promotion["test_set_sha256"] != score_split(model, shards)["test_set_sha256"]
    write_json(tmp_path / "baseline" / "metrics.json", at_promotion)
    record = {"test_set_sha256": at_promotion["test_set_sha256"], "class_names": manifest["class_names"],
              "images": promoted}  # fmt: skip
    write_json(tmp_path / "baseline" / "test_set.json", record)
    state = nightly(tmp_path)
    assert state.is_completed(), (state.name, state.message)
    assert state.result()["metrics"]["num_samples"] == len(promoted)


@pytest.mark.slow  # about 3 min: a server, a worker, a tiny train-flow/prod run, a serving process, the nightly
def test_a_nightly_run_against_a_drifting_server_ends_in_drift_and_notifies(
    tmp_path: Path, webhook: tuple[str, list[bytes]]
) -> None:
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    hook_url, received = webhook
    with production_project(tmp_path) as prod:
        proc, run = prod.run_and_watch("train-flow/prod")
        assert proc.returncode == 0 and run.state.is_completed(), run.state.message or proc.stdout[-3000:]
        promote = subprocess.run([str(VENV / "bin" / "python"), "-m", "tasks.tools.promote"], cwd=prod.repo,
                                 env=env_with_venv(), capture_output=True, text=True)  # fmt: skip
        assert promote.returncode == 0, promote.stdout + promote.stderr
        with prod.client():
            CustomWebhookNotificationBlock(name="drift", url=hook_url, json_data={"text": "{{body}}"}).save(
                "drift-hook", overwrite=True
            )
        automations = subprocess.run([str(VENV / "bin" / "python"), "-m", "flows.automations", "--drift-notify",
                                      "custom-webhook/drift-hook"], cwd=prod.repo, env=prod.env,
                                     capture_output=True, text=True)  # fmt: skip
        assert automations.returncode == 0, automations.stdout + automations.stderr
        # fixed thresholds: a window of 20 is far from the 200/500 export calibrated for (the flow is tested here)
        drift = DriftParams(window=20, min_predictions=10, class_mix_psi=0.25, top1_psi=0.25, margin_psi=0.25)
        one_class = sorted(p for p in (prod.repo / "data/generated").iterdir() if p.is_dir())[0]
        images = sorted(one_class.iterdir())
        with running_server(prod.repo, tmp_path / "review", drift=drift) as (url, _):
            for i in range(20):
                response = httpx.post(f"{url}/predict", content=images[i % len(images)].read_bytes(),
                                      headers={"content-type": "application/octet-stream"})  # fmt: skip
                assert response.status_code == 200, response.text
            nightly = prod.prefect("deployment", "run", "regression-flow/nightly", "-p", f"server={url}", "--watch")
        run = prod.latest_run("nightly")
        assert run.state.name == "Drift" and run.state.is_failed(), (run.state.name, run.state.message)
        assert "_psi " in run.state.message and "the regression check passed" in run.state.message
        assert "Drift" in nightly.stdout + nightly.stderr
        artifacts = prod.artifacts(run.id)
        assert {"regression-flow-verdict", "regression-flow-drift", "regression-flow-drift-figure"} <= set(artifacts)
        assert "data:image/png;base64," in artifacts["regression-flow-drift-figure"].data
        deadline = time.monotonic() + 60
        while not received and time.monotonic() < deadline:
            time.sleep(1)
        assert received, "the drift automation sent nothing to the webhook within 60 s"
        text = json.loads(received[0])["text"]
        assert "Drift" in text and "_psi " in text and "regression-flow" in text, text


def test_each_nightly_check_is_one_mlflow_run_and_an_unchanged_night_adds_none(
    promoted_project: Path, prefect_api: None
) -> None:
    from tasks.release import tracking

    for _ in range(2):
        assert nightly(promoted_project).is_completed()
    client = tracking.client(f"sqlite:///{promoted_project / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("imagepipe").experiment_id])
    nights = [r for r in runs if r.data.tags.get("source") == "regression-flow"]
    assert len(nights) == 1, [r.data.tags for r in runs]
    onnx_sha256 = sha256_file(promoted_project / "baseline" / "model.onnx")
    assert (
        nights[0].data.tags["production.onnx_sha256"] == onnx_sha256 and nights[0].data.tags["gate.verdict"] == "pass"
    )
    assert "test_accuracy" in nights[0].data.metrics and nights[0].data.tags["prefect.flow_run_id"]
