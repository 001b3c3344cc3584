"""ASGI middleware: the request-body size limit (counted while reading) and per-request metrics.

HTTP scope + receive/send -> the app's response, or a JSON 413 once the body passes `max_bytes`
(from the Content-Length header before reading, or from the bytes counted as they arrive).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import MutableMapping
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

REASON_KEY = "serving.error_reason"


def set_reason(scope: MutableMapping[str, Any], reason: str) -> None:
    """Tag the response with why it failed, for the errors-by-code metric."""
    scope[REASON_KEY] = reason


class BodyTooLarge(Exception):
    pass


async def _send_json(send: Send, status: int, body: dict[str, str]) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    # The rest of the body is never read: tell the client this connection is done.
    headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class BodyLimitMiddleware:
    """413 for bodies over `max_bytes`, before the whole body is ever in memory."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        detail = f"request body over serve.max_body_bytes {self.max_bytes}"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                set_reason(scope, "bad_content_length")
                await _send_json(send, 400, {"error": "bad_content_length", "detail": f"Content-Length {length!r}"})
                return
            if declared > self.max_bytes:
                set_reason(scope, "body_too_large")
                body = {"error": "body_too_large", "detail": f"Content-Length {declared}: {detail}"}
                await _send_json(send, 413, body)
                return
        seen = 0
        exceeded = False
        started = False

        async def counting_receive() -> Message:
            nonlocal seen, exceeded
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    exceeded = True
                    raise BodyTooLarge(detail)
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if exceeded:  # whatever the app made of the aborted read (400, 500), the answer is 413
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        with contextlib.suppress(BodyTooLarge):
            await self.app(scope, counting_receive, guarded_send)
        if exceeded and not started:
            set_reason(scope, "body_too_large")
            await _send_json(send, 413, {"error": "body_too_large", "detail": f"over {seen - 1} bytes read: {detail}"})


class RequestMetricsMiddleware:
    """Requests by endpoint and code, latency histogram, errors by code and reason."""

    def __init__(self, app: ASGIApp, metrics: Any) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        start = time.perf_counter()

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            # Route templates only, so a scan of random URLs cannot grow the label set.
            route = scope.get("route")
            endpoint = getattr(route, "path", "other")
            self.metrics.requests.labels(endpoint=endpoint, code=str(status)).inc()
            self.metrics.latency.labels(endpoint=endpoint).observe(time.perf_counter() - start)
            if status >= 400:
                reason = scope.get(REASON_KEY, "server_error" if status >= 500 else "http_error")
                self.metrics.errors.labels(code=str(status), reason=reason).inc()
