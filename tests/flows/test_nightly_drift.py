"""The nightly check against a drifting server, the way a user runs it: a real Prefect server and worker
(scripts/prefect.sh), train-flow/prod, promote, a real uvicorn on the promoted model fed one class, then
`prefect deployment run regression-flow/nightly -p server=...`: the run ends in Drift, its artifacts are
there, and the drift automation's notification reaches a webhook (a real HTTP server in this test)."""

from __future__ import annotations

import http.server
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tasks.core.params import DriftParams
from tests.helpers.prefect import VENV, free_port, production_project
from tests.helpers.project import env_with_venv
from tests.helpers.serving import running_server


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
        drift = DriftParams(window=20, min_predictions=10)
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
