"""How POST /predict's image arrives: the raw body (Content-Type image/* or application/octet-stream) or the
multipart field `file`; PREDICT_BODY documents both in the OpenAPI schema (the route reads the request itself).

request -> (name, bytes), or an HTTPException the app's handlers turn into the JSON error body.
"""

from __future__ import annotations

from fastapi import HTTPException, Request
from python_multipart.multipart import parse_options_header
from starlette.datastructures import UploadFile

# POST /predict's body, both ways (the route reads the request itself, so FastAPI documents it from here).
_BINARY = {"schema": {"type": "string", "format": "binary"}}
PREDICT_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/octet-stream": _BINARY,
            "image/*": _BINARY,
            "multipart/form-data": {
                "schema": {"type": "object", "required": ["file"], "properties": {"file": _BINARY["schema"]}}
            },
        },
    }
}
RAW_TYPES = ("image/", "application/octet-stream")
FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")


async def upload_of(request: Request) -> tuple[str, bytes]:
    """The one image of a POST /predict: the raw body (image/*, application/octet-stream; its name from
    Content-Disposition's filename, else "body") or the multipart field `file`."""
    content_type = request.headers.get("content-type", "")
    media = content_type.partition(";")[0].strip().lower()
    if media.startswith(RAW_TYPES):
        _, options = parse_options_header(request.headers.get("content-disposition", ""))
        name = options.get(b"filename", b"body").decode("utf-8", "replace") or "body"
        return name, await request.body()
    if media in FORM_TYPES:  # a urlencoded form cannot carry a file: 422 naming the field, as before
        async with request.form() as form:
            file = form.get("file")
            if not isinstance(file, UploadFile):
                raise HTTPException(422, "invalid_request: body.file: Field required (a multipart file field `file`)")
            return file.filename or "file", await file.read()
    raise HTTPException(415, f"unsupported_media_type: Content-Type {content_type!r}; send the image as the body "
                        "with image/* or application/octet-stream, or as multipart/form-data field `file`")  # fmt: skip
