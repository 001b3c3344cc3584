"""Fixtures of the flow tests."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from tests.helpers.drift import DriftServer


@pytest.fixture
def drift_server() -> Iterator[DriftServer]:
    server = DriftServer()
    threading.Thread(target=server.httpd.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()
