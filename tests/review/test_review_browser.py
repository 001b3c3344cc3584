"""The review page in a real browser (headless chromium through playwright), started as `make review` starts it:
every image a loaded picture, labelling by keyboard, a shift-click range, undo, a fix-in-place of a label-error
candidate inside a real DVC-tracked dataset, and not one request leaving 127.0.0.1."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from tests.helpers.project import dvc, make_project
from tests.helpers.review import candidate, log_lines, review_page, tracked_project, upload

pytestmark = pytest.mark.slow
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright drives the browser of these tests")
CHROMIUM = "/usr/bin/chromium"  # `playwright install` cannot download here: apt-get install -y chromium


@contextmanager
def another_local_server() -> Iterator[tuple[str, list[dict[str, str]]]]:
    """A server on another port of 127.0.0.1 that records the headers of every request it gets."""
    heard: list[dict[str, str]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            heard.append(dict(self.headers))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<p>another page</p>")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", heard
    finally:
        server.shutdown()


def open_page(p: object, url: str, requests: list[str]) -> object:
    browser = p.chromium.launch(executable_path=CHROMIUM)  # type: ignore[attr-defined]
    page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()  # a context: more pages in it
    page.on("request", lambda request: requests.append(request.url))
    page.goto(url)
    page.wait_for_load_state("networkidle")
    return page


def test_label_by_keyboard_a_shift_click_range_and_undo(tmp_path: Path) -> None:
    repo = make_project(tmp_path / "repo")  # the generated default data: no tracked dataset, the page still labels
    review = repo / "data" / "review"
    guesses = ["cat", "dog", "bird", "cat", "dog", "bird"]
    shas = [upload(review, {g: 0.40 + i / 100, **{c: (0.60 - i / 100) / 2 for c in ("cat", "dog", "bird") if c != g}},
                   seed=i) for i, g in enumerate(guesses)]  # fmt: skip
    expect = sync_api.expect
    requests: list[str] = []
    with review_page(repo) as (url, output), sync_api.sync_playwright() as p:
        assert f"the review page: {url} (Ctrl-C stops it)" in output.read_text() and "/?token=" in url
        clean = url.split("?")[0]
        assert httpx.get(clean).status_code == 403  # without the token: nothing, not even the page
        page = open_page(p, url, requests)
        assert page.url == clean  # the token became a cookie the page's script cannot read
        (cookie,) = page.context.cookies()
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and page.evaluate("document.cookie") == ""
        with another_local_server() as (other, heard):  # a notebook on another port: the token never reaches it
            page.context.new_page().goto(other)
            assert heard and all("imagepipe" not in h.get("Cookie", "") for h in heard), heard
        cards = page.locator(".card")
        assert cards.count() == 6
        loaded = page.eval_on_selector_all("#grid img", "imgs => imgs.map(i => i.complete ? i.naturalWidth : 0)")
        assert len(loaded) == 6 and all(width == 24 for width in loaded)  # every picture decoded, not a broken icon
        assert page.eval_on_selector("#grid img", "i => getComputedStyle(i).imageRendering") == "pixelated"
        assert page.locator(".class-key").all_inner_texts() == ["1 bird", "2 cat", "3 dog"]
        ids = [cards.nth(i).get_attribute("data-id") for i in range(6)]
        assert ids == shas  # least sure first: top-1 0.40, 0.41, ...
        for i, guess in enumerate(guesses):  # every card: the model's guess, its top 3 and why it was kept
            text = cards.nth(i).inner_text()
            assert f"guess {guess}" in text and f"low confidence: top-1 {0.40 + i / 100:.2f}" in text, text

        page.keyboard.press("ArrowRight")  # the second card (a dog guess) ...
        page.keyboard.press("1")  # ... filed under bird
        expect(page.locator("#message")).to_have_text("1 image(s) filed under bird")
        assert (review / "bird" / f"{shas[1]}.png").is_file() and not (review / "dog" / f"{shas[1]}.png").exists()

        cards.nth(2).click()
        cards.nth(4).click(modifiers=["Shift"])
        assert page.locator(".card.selected").count() == 3
        page.keyboard.press("3")
        expect(page.locator("#message")).to_have_text("3 image(s) filed under dog")
        assert all((review / "dog" / f"{sha}.png").is_file() for sha in shas[2:5])

        page.keyboard.press("u")
        expect(page.locator("#message")).to_have_text("undone: label of 3 image(s), back in bird, cat, dog")
        for sha, guess in zip(shas[2:5], guesses[2:5], strict=True):
            assert (review / guess / f"{sha}.png").is_file() and (review / guess / f"{sha}.json").is_file()
        assert (review / "bird" / f"{shas[1]}.png").is_file()  # the earlier decision stands
        whats = [(e["what"], e["sha256"]) for e in log_lines(review / ".decisions.jsonl")]
        assert whats == [("label", shas[1]), *[("label", s) for s in shas[2:5]], *[("undo", s) for s in shas[2:5]]]

        page.locator("#take-in-button").focus()  # Tab's stop: Enter is the button's, not "accept the guess"
        page.keyboard.press("Enter")
        expect(page.locator("#message")).to_contain_text("take-in: this page has no DVC-tracked dataset")
        assert len(log_lines(review / ".decisions.jsonl")) == len(whats)  # no image was filed by that Enter
        page.context.browser.close()
    assert requests and all(urlparse(u).hostname == "127.0.0.1" for u in requests), requests
    assert any(u.endswith("/static/review.js") for u in requests) and any("/img/review/" in u for u in requests)


def test_fix_a_label_error_candidate_in_place_from_the_page(tmp_path: Path) -> None:
    repo = tracked_project(tmp_path)
    review, dest = repo / "data" / "review", repo / "data" / "raw" / "pets"
    wrong = dest / "class_0" / "class_0_002.jpg"
    original = wrong.read_bytes()
    sha = candidate(review, wrong, repo, given="class_0", suggested="class_1")
    expect = sync_api.expect
    requests: list[str] = []
    with review_page(repo) as (url, _), sync_api.sync_playwright() as p:
        page = open_page(p, url, requests)
        card = page.locator(".card")
        assert card.count() == 1 and "the dataset says class_0" in card.inner_text()
        page.keyboard.press("f")
        expect(page.locator("#message")).to_contain_text("fixed in place: 1 file(s) moved in data/raw/pets")
        assert page.locator(".card").count() == 0
        page.context.browser.close()
    assert not wrong.exists() and (dest / "class_1" / wrong.name).read_bytes() == original
    assert json.loads(dvc("status", "--json", "data/raw/pets", cwd=repo).stdout or "{}") == {}
    assert not list(review.rglob(f"{sha}.*"))
    (entry,) = log_lines(repo / "data" / "raw" / "pets.decisions.jsonl")
    assert entry["what"] == "fix-in-place" and entry["to"] == f"data/raw/pets/class_1/{wrong.name}"
    assert all(urlparse(u).hostname == "127.0.0.1" for u in requests), requests
