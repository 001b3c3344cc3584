"""The project's own entry points check what they need first and say the one-line fix: the Prefect
server (make targets, scripts/prefect.sh, `python -m flows.launch`)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.helpers.project import ROOT, env_with_venv

pytestmark = pytest.mark.fast  # unit-level: make test-fast


def closed_port_url() -> str:
    with socket.socket() as s:  # bound, never listening: connections are refused
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/api"


@pytest.mark.parametrize(
    "command",
    [
        [sys.executable, "-m", "flows.launch", "train-flow/prod"],
        ["bash", "scripts/prefect.sh", "deploy"],
        ["bash", "scripts/prefect.sh", "worker"],
        ["bash", "scripts/prefect.sh", "run", "train-flow/prod"],
    ],
    ids=["launch", "prefect.sh deploy", "prefect.sh worker", "prefect.sh run"],
)
def test_an_unreachable_prefect_server_is_one_line_naming_the_url_and_the_fix(command: list[str], tmp_path) -> None:
    url = closed_port_url()
    env = {**env_with_venv(), "PREFECT_API_URL": url, "PREFECT_HOME": str(tmp_path)}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"error: no Prefect server answers at {url}")
    assert lines[0].endswith("start it with `make prefect-server`")
