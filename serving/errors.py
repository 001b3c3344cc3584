"""Every error the app answers, ours or the framework's, as the body {"error": reason, "detail": ...} with its
status: a bad upload's ImageError reason -> a 4xx, never a 5xx; an unexpected failure -> 500 with the details in
the log, not in the answer."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.limits import set_reason
from serving.schema import ErrorBody
from tasks.images.imaging import ImageError

# Bad bytes are the client's problem: each ImageError reason gets a 4xx, never a 5xx.
STATUS_BY_REASON = {
    "empty_file": 422,
    "not_an_image": 415,
    "unsupported_mode": 415,
    "truncated": 422,
    "decode_error": 422,
    "too_small": 422,
    "decompression_bomb": 413,
}


ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorBody} for code in (400, 413, 415, 422, 503)}
PLAIN_REASONS = {400: "bad_request", 404: "not_found", 405: "method_not_allowed"}


def _error(
    code: int, reason: str, detail: str, request: Request, headers: dict[str, str] | None = None
) -> JSONResponse:
    set_reason(request.scope, reason)
    return JSONResponse({"error": reason, "detail": detail}, status_code=code, headers=headers)


def add_error_handlers(app: FastAPI) -> None:
    """Every error, ours or the framework's, as {"error": reason, "detail": ...} with its status."""

    @app.exception_handler(ImageError)
    async def _image_error(request: Request, exc: ImageError) -> JSONResponse:
        return _error(STATUS_BY_REASON.get(exc.reason, 422), exc.reason, str(exc), request)

    # Starlette's class: it also catches what the framework raises itself (a malformed multipart
    # body, an unknown route), so every error has the same {"error", "detail"} body.
    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = str(exc.detail)
        code, _, rest = detail.partition(": ")
        if not (rest and code.isidentifier()):  # ours read "reason_code: what happened"
            code = PLAIN_REASONS.get(exc.status_code, "http_error")
        return _error(exc.status_code, code, detail, request, exc.headers)  # keeps a 405's Allow header

    # Anything else (a bug, onnxruntime failing mid-call) is still a JSON body, not Starlette's plain text;
    # the traceback goes to the log (Starlette re-raises it for uvicorn to log), not to the client.
    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        return _error(500, "internal_error", f"the server failed on this request ({type(exc).__name__}); "
                      "its log has the details", request)  # fmt: skip

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return _error(422, "invalid_request", detail, request)
