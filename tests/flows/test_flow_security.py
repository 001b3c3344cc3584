"""Security defaults of the local Prefect server that scripts/prefect.sh starts: a real server, real HTTP.

Loopback only; with PREFECT_API_AUTH_STRING set, every API call but the health probe needs basic auth;
state-changing calls need a CSRF token; the prefect CLI, given the same auth string, still works.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest

from tests.helpers.prefect import VENV, free_port, prefect_env
from tests.helpers.project import ROOT

SCRIPT = ROOT / "scripts" / "prefect.sh"
AUTH = ("tester", "correct-horse-battery")


def script(command: str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), command], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    home, port = tmp_path_factory.mktemp("prefect-home"), free_port()
    env = prefect_env(home, port, PREFECT_API_AUTH_STRING=":".join(AUTH))
    started = script("server", env)
    assert started.returncode == 0, started.stdout + started.stderr
    url = f"http://127.0.0.1:{port}/api"
    try:
        yield {"env": env, "url": url, "port": port, "home": home}
    finally:
        stopped = script("stop", env)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")


def test_server_listens_on_loopback_only(secured: dict[str, Any]) -> None:
    listening = [
        c.laddr.ip
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == secured["port"]
    ]
    assert listening == ["127.0.0.1"]


def test_api_needs_basic_auth(secured: dict[str, Any]) -> None:
    url = secured["url"]
    assert httpx.get(f"{url}/health").status_code == 200  # liveness probes stay open
    assert httpx.get(f"{url}/admin/version").status_code == 401
    assert httpx.get(f"{url}/admin/version", auth=("tester", "wrong")).status_code == 401
    assert httpx.get(f"{url}/admin/version", auth=AUTH).status_code == 200


def test_state_changes_need_a_csrf_token(secured: dict[str, Any]) -> None:
    url = secured["url"]
    refused = httpx.post(f"{url}/flows/filter", json={}, auth=AUTH)
    assert refused.status_code == 403 and "CSRF" in refused.text
    token = httpx.get(f"{url}/csrf-token", params={"client": "test-client"}, auth=AUTH).json()["token"]
    headers = {"Prefect-Csrf-Token": token, "Prefect-Csrf-Client": "test-client"}
    assert httpx.post(f"{url}/flows/filter", json={}, auth=AUTH, headers=headers).status_code == 200
    wrong = {**headers, "Prefect-Csrf-Token": "forged"}
    assert httpx.post(f"{url}/flows/filter", json={}, auth=AUTH, headers=wrong).status_code == 403


def test_cli_works_with_the_auth_string_and_fails_without(secured: dict[str, Any]) -> None:
    created = script("pool", secured["env"])
    assert created.returncode == 0, created.stdout + created.stderr
    prefect = [str(VENV / "bin" / "prefect"), "work-pool", "inspect", "local-process"]
    base = {**secured["env"], "PREFECT_API_URL": secured["url"]}
    ok = subprocess.run(prefect, env=base, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "local-process" in ok.stdout
    wrong = subprocess.run(
        prefect, env={**base, "PREFECT_API_AUTH_STRING": "tester:wrong"}, capture_output=True, text=True, timeout=120
    )
    assert wrong.returncode != 0
