"""The review page: FastAPI + Jinja2, server-rendered, every script and style served by itself (offline).

GET / renders the images (sorted, filtered by the model's guess); GET /img/... serves images from the review
folder and the dataset only; POST /api/... decides (label, discard, undo, classes, fix, take-in, accept) and
answers JSON, a refusal as {"error": "<one line>"} with its status (400, 403, 404, 409, 410). Every request needs
the token made at start (Jupyter's way): `/<page>/?token=...` sets it as a cookie, then redirects to the clean URL.
Everything lives under `/<page>/`, a random path made at start with the token, and the cookie's Path is that
path: browsers send a 127.0.0.1 cookie to every port of 127.0.0.1, but only under its Path, so another local
server (a notebook, any page on another port) never receives the token, which it could otherwise replay here.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from tasks.core.errors import StageError
from tasks.images.imaging import is_image_name
from tasks.tools.review import accept as gate
from tasks.tools.review import actions, fix, intake
from tasks.tools.review.items import classes, list_items, sort_items, standing_of
from tasks.tools.review.refusals import NotFound
from tasks.tools.review.state import Review

HERE = Path(__file__).parent
SORTS = {"confidence": "least sure first", "newest": "newest first", "oldest": "oldest first"}
PAGE_KEYS = {"Enter": "accept the model's guess", "x": "discard", "u": "undo the last decision",
             "f": "fix a label-error candidate in place", "←↑→↓": "move (with Shift: select)",
             "Ctrl+A": "select all", "n": "name a new class"}  # fmt: skip


class Ref(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    folder: str  # where the page saw the image: a move since then is a 409


class Selection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    items: list[Ref] = Field(default_factory=list)
    to: str | None = None  # a class; None with label: each image's model guess


class Named(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = ""


class Reason(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = ""


def _refs(selection: Selection) -> list[tuple[str, str]]:
    return [(ref.id, ref.folder) for ref in selection.items]


def _served(base: Path | None, rel: str, what: str) -> FileResponse:
    """A file of `base` by its relative path; anything resolving outside it (.., links) is a 404."""
    if base is not None and base.is_dir() and ".." not in Path(rel).parts:
        target = (base / rel).resolve()
        if base.resolve() in target.parents and target.is_file() and is_image_name(target.name):
            return FileResponse(target, headers={"Cache-Control": "no-cache"})
    raise NotFound(f"{rel}: not an image of {what}")


# style-src 'unsafe-inline': the probability bars' widths are style attributes; no inline script runs
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self'; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


COOKIE = "imagepipe_review"  # its Path is the page's own /<page>/: two pages of one machine keep their own


def create_app(review: Review, allowed_hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
               token: str | None = None) -> FastAPI:  # fmt: skip
    """The page; `token`: what every request must carry (None: a new random one), as app.state.token. The page is
    at app.state.base (`/<page>/`, random); `make review` prints app.state.base + `?token=...`."""
    app = FastAPI(title="imagepipe review", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.token = token or secrets.token_urlsafe(32)
    base = app.state.base = f"/{secrets.token_urlsafe(12)}/"
    templates = Jinja2Templates(directory=HERE / "templates")
    app.mount(f"{base}static", StaticFiles(directory=HERE / "static"), name="static")
    site = APIRouter()  # every route, under `base` (the links and the script's requests are relative to it)

    @app.middleware("http")
    async def same_machine_only(request: Request, call_next: Any) -> Any:
        """Only this machine's own pages, for whoever has the token: a Host other than 127.0.0.1 (DNS rebinding), a
        POST that is not JSON (a cross-site form, which no browser preflights) or a request without the token
        (another local user's curl; the cookie is SameSite=Strict, so no other site's page sends it) is refused."""
        if request.url.hostname not in allowed_hosts:
            return JSONResponse({"error": f"host {request.url.hostname!r}: the review page answers on 127.0.0.1 "
                                          "only"}, status_code=403)  # fmt: skip
        json_body = request.headers.get("content-type", "").startswith("application/json")
        if request.method == "POST" and not json_body:
            return JSONResponse({"error": "POST bodies are JSON (Content-Type: application/json)"}, status_code=415)
        given = request.query_params.get("token")
        if given is not None and secrets.compare_digest(given.encode(), app.state.token.encode()):
            if request.method == "GET" and request.url.path in ("/", base):  # the URL printed: the cookie, once
                clean = request.url.remove_query_params("token")
                answer = RedirectResponse(f"{base}?{clean.query}" if clean.query else base, status_code=303)
                answer.set_cookie(COOKIE, app.state.token, path=base, httponly=True, samesite="strict")
                return answer
            return await call_next(request)
        cookie = request.cookies.get(COOKIE, "")
        if not secrets.compare_digest(cookie.encode(), app.state.token.encode()):
            return JSONResponse({"error": "no access: open the URL `make review` printed (http://127.0.0.1:"
                                          f"{request.url.port or 80}/<page>/?token=...)"}, status_code=403)  # fmt: skip
        return await call_next(request)

    @app.middleware("http")
    async def no_framing(request: Request, call_next: Any) -> Any:
        """Added last, so it wraps the check above: every answer, a refusal too, says that no other page may
        frame this one (clickjacking a keyboard-driven page), that it runs only its own script and styles, and
        that it sends no Referer (the token is in the first URL)."""
        answer = await call_next(request)
        answer.headers.update(SECURITY_HEADERS)
        return answer

    @app.exception_handler(StageError)
    async def refused(_: Request, exc: StageError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=getattr(exc, "status", 409))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def malformed(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return JSONResponse({"error": f"request {where or 'body'}: {first.get('msg')}"}, status_code=400)

    def listing(sort: str, guess: str | None) -> dict[str, Any]:
        items = list_items(review)
        standing = standing_of(review)
        dest = review.dataset.dest if review.dataset else None
        shown = [i.to_json(standing.get(i.id), dest) for i in sort_items(items, sort, guess)]
        return {"items": shown, "classes": classes(review, items), "total": len(items)}

    @site.get("/", response_class=HTMLResponse)
    def page(request: Request, sort: str = "confidence", guess: str | None = None) -> Any:
        sort = sort if sort in SORTS else "confidence"
        data = listing(sort, guess or None)
        context = {"data": data, "sort": sort, "sorts": SORTS, "guess": guess or "", "page_keys": PAGE_KEYS,
                   "review_dir": review.review_dir, "dataset": review.dataset, "log": review.log.path,
                   "source": review.params.data.source, "who": review.log.who}  # fmt: skip
        return templates.TemplateResponse(request, "review.html", context)

    @site.get("/api/items")
    def items(sort: str = "confidence", guess: str | None = None) -> dict[str, Any]:
        return listing(sort if sort in SORTS else "confidence", guess or None)

    @site.get("/img/review/{rel:path}")
    def review_image(rel: str) -> FileResponse:
        return _served(review.review_dir, rel, f"the review folder {review.review_dir}")

    @site.get("/img/dataset/{rel:path}")
    def dataset_image(rel: str) -> FileResponse:
        base = review.dataset.dest if review.dataset else None
        return _served(base, rel, f"the dataset {base}" if base else "a dataset (this page has none)")

    @site.post("/api/label")
    def label(selection: Selection) -> dict[str, Any]:
        return {"entries": actions.label(review, _refs(selection), selection.to)}

    @site.post("/api/discard")
    def discard(selection: Selection) -> dict[str, Any]:
        return {"entries": actions.discard(review, _refs(selection))}

    @site.post("/api/undo")
    def undo() -> dict[str, Any]:
        return {"entries": actions.undo(review)}

    @site.post("/api/classes")
    def new_class(named: Named) -> dict[str, Any]:
        name = actions.add_class(review, named.name)
        return {"name": name, "classes": classes(review, list_items(review))}

    @site.post("/api/fix")
    def fix_in_place(selection: Selection) -> dict[str, Any]:
        return fix.fix_in_place(review, _refs(selection))

    @site.post("/api/take-in")
    def take_in() -> dict[str, Any]:
        return intake.take_in(review)

    @site.post("/api/accept")
    def accept(reason: Reason) -> dict[str, Any]:
        return gate.accept(review, reason.reason)

    app.include_router(site, prefix=base.rstrip("/"))
    return app
