"""The review page (`make review`) through FastAPI's TestClient, over real files: review folders written as the
server and make review-label-errors write them, and for the take-in and fix-in-place a real DVC-tracked dataset in
a real git repository. Every refusal is one line and leaves every file where it was."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient

from tasks.core.git import author
from tasks.core.params import Params, load_params
from tasks.tools.data_merge import merge as intake_merge
from tasks.tools.review import decisions
from tasks.tools.review.app import create_app
from tasks.tools.review.intake import restore_stale
from tasks.tools.review.state import open_review
from tests.helpers.project import dvc, sh
from tests.helpers.review import candidate, files, log_lines, page, png, ref, review_files, upload

CLASSES = ("cat", "dog", "bird")


@pytest.fixture
def traffic(tmp_path: Path) -> dict[str, str]:
    """Five uploads in data/review/ of tmp_path: name -> sha256, top-1 0.36 .. 0.48."""
    review = tmp_path / "data" / "review"
    shas = {}
    for i, (name, p) in enumerate([("a", 0.48), ("b", 0.36), ("c", 0.44), ("d", 0.38), ("e", 0.40)]):
        guess = CLASSES[i % 3]
        rest = [c for c in CLASSES if c != guess]
        probabilities = {guess: p, rest[0]: p - 0.05, rest[1]: 1.05 - 2 * p}
        shas[name] = upload(review, probabilities, seed=i, saved_at=f"2025-05-0{i + 1}T10:00:00Z")
    return shas


@pytest.mark.fast
def test_the_listing_sorts_least_sure_first_filters_by_guess_and_shows_why(
    tmp_path: Path, traffic: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, _ = page(tmp_path, monkeypatch)
    listing = client.get("/api/items").json()
    assert [i["id"] for i in listing["items"]] == [traffic[n] for n in "bdeca"]  # top-1 0.36, 0.38, 0.40, 0.44, 0.48
    first = listing["items"][0]
    assert first["guess"] == "dog" and first["folder"] == "dog" and first["saved_at"] == "2025-05-02T10:00:00Z"
    assert [name for name, _ in first["top3"]] == ["dog", "bird", "cat"] and first["top3"][0][1] == 0.36
    assert first["reason"] == "low confidence: top-1 0.36, margin 0.03" and first["decided"] is None
    assert listing["classes"] == [{"name": c, "key": k} for c, k in zip(("bird", "cat", "dog"), "123", strict=True)]
    newest = client.get("/api/items", params={"sort": "newest"}).json()["items"]
    assert [i["saved_at"][:10] for i in newest] == [f"2025-05-0{d}" for d in (5, 4, 3, 2, 1)]
    only_cats = client.get("/api/items", params={"guess": "cat"}).json()["items"]
    assert {i["id"] for i in only_cats} == {traffic["a"], traffic["d"]}

    html = client.get("/", params={"guess": "cat"}).text
    assert html.count('class="card') == 2 and "<kbd>1</kbd> bird" in html and "<kbd>x</kbd> discard" in html
    assert 'src="static/review.js"' in html and "http" not in html.split("<body>")[1].replace("http://", "")
    assert client.get("/static/review.js").status_code == 200 and client.get("/static/review.css").status_code == 200
    image = client.get(first["url"])
    assert image.status_code == 200 and image.content == (tmp_path / "data/review/dog" / first["name"]).read_bytes()


@pytest.mark.fast
def test_label_range_new_class_discard_and_undo_move_files_and_append_to_the_log(
    tmp_path: Path, traffic: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, review = page(tmp_path, monkeypatch)
    root = tmp_path / "data" / "review"
    items = {i["id"]: i for i in client.get("/api/items").json()["items"]}
    a, b, c, d = (items[traffic[n]] for n in "abcd")

    one = client.post("/api/label", json={"items": [ref(a)], "to": "bird"})
    assert one.status_code == 200, one.text
    assert (root / "bird" / a["name"]).is_file() and (root / "bird" / f"{a['id']}.json").is_file()
    assert not (root / "cat" / a["name"]).exists() and not (root / "cat" / f"{a['id']}.json").exists()

    many = client.post("/api/label", json={"items": [ref(b), ref(c), ref(d)], "to": "cat"}).json()["entries"]
    assert {e["batch"] for e in many} == {many[0]["id"]} and [e["from"] for e in many] == ["dog", "bird", "cat"]
    assert all((root / "cat" / i["name"]).is_file() for i in (b, c, d))

    guess = client.post("/api/label", json={"items": [ref(items[traffic["e"]])]}).json()["entries"]  # Enter
    assert guess[0]["from"] == guess[0]["to"] == "dog"
    listed = {i["id"]: i for i in client.get("/api/items").json()["items"]}
    assert all(listed[traffic[n]]["decided"] for n in "abcde")

    undone = client.post("/api/undo", json={}).json()["entries"]  # Enter's accept of e
    assert [e["what"] for e in undone] == ["undo"] and undone[0]["undid"] == "label"
    listed = {i["id"]: i for i in client.get("/api/items").json()["items"]}
    assert listed[traffic["e"]]["decided"] is None and listed[traffic["a"]]["decided"] is not None
    undone = client.post("/api/undo", json={}).json()["entries"]  # the range: all three go back
    assert len(undone) == 3 and {e["undoes"] for e in undone} == {many[0]["batch"]}
    assert (root / "dog" / b["name"]).is_file() and (root / "bird" / c["name"]).is_file()
    assert (root / "cat" / d["name"]).is_file()

    added = client.post("/api/classes", json={"name": "hamster"}).json()
    assert {"name": "hamster", "key": "4"} in added["classes"]
    assert client.post("/api/label", json={"items": [ref(items[traffic["b"]])], "to": "hamster"}).status_code == 200
    assert (root / "hamster" / b["name"]).is_file()

    gone = client.post("/api/discard", json={"items": [ref(d)]}).json()["entries"]
    assert gone[0]["to"] == ".discarded/cat" and (root / ".discarded" / "cat" / d["name"]).is_file()
    assert (root / ".discarded" / "cat" / f"{d['id']}.json").is_file()
    assert d["id"] not in {i["id"] for i in client.get("/api/items").json()["items"]}
    client.post("/api/undo", json={})
    assert (root / "cat" / d["name"]).is_file() and not (root / ".discarded" / "cat" / d["name"]).exists()

    lines = log_lines(review.log.path)
    assert review.log.path == Path("data/review/.decisions.jsonl")  # no tracked dataset: beside the review images
    assert [e["what"] for e in lines] == ["label", "label", "label", "label", "label", "undo", "undo", "undo", "undo",
                                          "label", "discard", "undo"]  # fmt: skip
    assert [e["id"] for e in lines] == list(range(1, 13))
    assert all(e["who"] == review.log.who and e["when"].endswith("Z") for e in lines)
    assert review.log.who == author(tmp_path)  # the name promote's decision records too


@pytest.mark.fast
def test_a_second_browser_gets_409_naming_who_moved_it_and_a_vanished_file_410(
    tmp_path: Path, traffic: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, review = page(tmp_path, monkeypatch)
    root = tmp_path / "data" / "review"
    items = {i["id"]: i for i in client.get("/api/items").json()["items"]}
    a, b, c = (items[traffic[n]] for n in "abc")
    assert client.post("/api/label", json={"items": [ref(a)], "to": "dog"}).status_code == 200
    before = review_files(root)

    stale = client.post("/api/label", json={"items": [ref(b), ref(a)], "to": "bird"})  # the other browser saw cat/
    assert stale.status_code == 409
    who = review.log.who
    assert stale.json()["error"].startswith(f"image {a['id'][:12]} is no longer in cat/: {who} moved it to dog/ at ")
    assert review_files(root) == before  # b did not move either: all or nothing

    (root / "bird" / c["name"]).unlink()  # taken by someone else meanwhile
    (root / "bird" / f"{c['id']}.json").unlink()
    vanished = client.post("/api/discard", json={"items": [ref(c)]})
    assert vanished.status_code == 410 and "is gone from the review folder" in vanished.json()["error"]
    moved_by_hand = root / "cat" / b["name"]
    os.replace(root / "dog" / b["name"], moved_by_hand)
    by_hand = client.post("/api/label", json={"items": [ref(b)], "to": "bird"})
    assert by_hand.status_code == 409 and "it is in cat/ now, moved outside this page" in by_hand.json()["error"]
    assert len(log_lines(review.log.path)) == 1


@pytest.mark.fast
@pytest.mark.parametrize(
    ("name", "rule"),
    [
        ("", "class name is empty"),
        ("a/b", "is a path, not one folder name"),
        ("..", "is not a folder name"),
        (".hidden", "starts with '.': hidden folders are not read as classes"),
        ("x" * 256, "is 256 bytes long: a folder name holds at most 255"),
        ("é" * 128, "is 256 bytes long"),
        ("CON", "is a reserved device name on Windows"),
        ("train", "is a split folder name"),
        ("a:b", "contains ':'"),
        (" cat", "begins or ends with a space"),
    ],
)
def test_an_invalid_class_name_is_one_line_naming_the_rule_and_moves_nothing(
    tmp_path: Path, traffic: dict[str, str], monkeypatch: pytest.MonkeyPatch, name: str, rule: str
) -> None:
    client, _ = page(tmp_path, monkeypatch)
    root = tmp_path / "data" / "review"
    before = review_files(root)
    item = client.get("/api/items").json()["items"][0]
    for answer in (client.post("/api/classes", json={"name": name}),
                   client.post("/api/label", json={"items": [ref(item)], "to": name})):  # fmt: skip
        assert answer.status_code == 400 and rule in answer.json()["error"], answer.text
        assert "\n" not in answer.json()["error"]
    assert review_files(root) == before and not (root / ".decisions.jsonl").exists()


@pytest.mark.fast
def test_images_are_served_from_the_review_folder_only(
    tmp_path: Path, traffic: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, _ = page(tmp_path, monkeypatch)
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"not yours")
    (tmp_path / "data" / "review" / "cat" / "link.png").symlink_to(secret)
    for path in ("/img/review/%2e%2e/%2e%2e/secret.png", "/img/review/cat/link.png", "/img/review/cat/nope.png",
                 "/img/dataset/cat/x.png", "/img/review/cat/..%2f..%2f..%2fsecret.png"):  # fmt: skip
        answer = client.get(path)
        assert answer.status_code == 404 and answer.content != b"not yours", path
    assert client.post("/api/undo", content=b"{}", headers={"content-type": "text/plain"}).status_code == 415
    assert TestClient(client.app, base_url="http://evil.example").get("/").status_code == 403


@pytest.mark.fast
def test_an_image_name_with_url_characters_is_served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "data" / "review" / "sea lion #1 50%"
    folder.mkdir(parents=True)
    (folder / "a #?% b.png").write_bytes(png(5))
    (folder / "a #?% b.json").write_text('{"predicted": "sea lion #1 50%", "top1_probability": 0.4}')
    client, _ = page(tmp_path, monkeypatch)
    (item,) = client.get("/api/items").json()["items"]
    assert item["url"] == "img/review/sea%20lion%20%231%2050%25/a%20%23%3F%25%20b.png"  # relative to the page
    assert f'src="{item["url"]}"' in client.get("/").text
    image = client.get(item["url"])
    assert image.status_code == 200 and image.content == png(5)
    moved = client.post("/api/label", json={"items": [ref(item)], "to": "cat"})
    assert moved.status_code == 200 and client.get(client.get("/api/items").json()["items"][0]["url"]).content == png(5)


@pytest.mark.fast
def test_without_the_token_every_request_is_refused_and_its_url_sets_a_strict_cookie(
    tmp_path: Path, traffic: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    app = create_app(open_review(Params(), None, tmp_path))
    base = app.state.base
    stranger = TestClient(app, base_url=f"http://127.0.0.1{base}")  # another local user's curl: no cookie, no token
    root = tmp_path / "data" / "review"
    before = review_files(root)
    sha = traffic["a"]
    for method, path in [("GET", "/"), ("GET", "/api/items"), ("GET", "/static/review.js"),
                         ("GET", f"/img/review/cat/{sha}.png"), ("GET", "/?token=wrong"), ("POST", "/api/undo"),
                         ("POST", "/api/accept"), ("POST", "/api/take-in"), ("POST", "/api/fix"),
                         ("POST", "/api/label?token=wrong"), ("GET", "http://127.0.0.1/")]:  # fmt: skip
        answer = stranger.request(method, path, json={"items": [{"id": sha, "folder": "cat"}], "reason": "why"})
        assert answer.status_code == 403, (method, path)
        assert answer.json()["error"] == ("no access: open the URL `make review` printed "
                                          "(http://127.0.0.1:80/<page>/?token=...)")  # fmt: skip
    assert review_files(root) == before and not (root / ".decisions.jsonl").exists()
    other = create_app(open_review(Params(), None, tmp_path)).state
    assert other.token != app.state.token and other.base != base  # new at each start

    entry = stranger.get(f"/?sort=newest&token={app.state.token}", follow_redirects=False)
    assert entry.status_code == 303 and entry.headers["location"] == f"{base}?sort=newest"
    cookie = entry.headers["set-cookie"]
    assert cookie.startswith(f"imagepipe_review={app.state.token};") and "HttpOnly" in cookie
    assert "SameSite=strict" in cookie and f"Path={base}" in cookie
    assert stranger.get("/api/items").status_code == 200  # the cookie from now on
    scripted = TestClient(app, base_url=f"http://127.0.0.1{base}")  # or the token on each request
    assert scripted.get(f"/api/items?token={app.state.token}").status_code == 200
    labelled = scripted.post(f"/api/label?token={app.state.token}", json={"items": [{"id": sha, "folder": "cat"}]})
    assert labelled.status_code == 200 and (root / "cat" / f"{sha}.png").is_file()


@pytest.mark.fast
def test_the_cookie_goes_to_the_pages_own_path_and_to_no_other_local_server(
    tmp_path: Path, traffic: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cookie for 127.0.0.1 goes to every port of 127.0.0.1 (cookies ignore ports), so a notebook or any other
    local server on another port would receive the token and could replay it here: the cookie's Path is the
    page's own random path, which nothing else on the machine serves or knows."""
    monkeypatch.chdir(tmp_path)
    app = create_app(open_review(Params(), None, tmp_path))
    browser = TestClient(app, base_url="http://127.0.0.1:8010")  # one cookie jar, as a browser's
    assert browser.get(f"{app.state.base}?token={app.state.token}").status_code == 200  # redirected to the page
    assert browser.cookies.get("imagepipe_review") == app.state.token
    for elsewhere in ("http://127.0.0.1:8888/", "http://127.0.0.1:8888/api/items", "http://127.0.0.1:8010/"):
        assert "cookie" not in browser.build_request("GET", elsewhere).headers, elsewhere
    assert browser.build_request("GET", f"http://127.0.0.1:8010{app.state.base}api/items").headers["cookie"] == (
        f"imagepipe_review={app.state.token}"
    )  # the page itself gets it


@pytest.mark.fast
def test_no_other_page_may_frame_the_review_page_or_run_script_in_it(
    tmp_path: Path, traffic: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any page served on 127.0.0.1 could frame a keyboard-driven page and click through it: every answer, a
    refusal too, forbids framing (CSP frame-ancestors 'none', X-Frame-Options DENY), other scripts, and Referer."""
    monkeypatch.chdir(tmp_path)
    app = create_app(open_review(Params(), None, tmp_path))
    client = TestClient(app, base_url=f"http://127.0.0.1{app.state.base}")
    for answer in (client.get(f"/?token={app.state.token}"), client.get("/api/items"), client.get("/static/review.js"),
                   TestClient(app, base_url="http://127.0.0.1").get("/")):  # fmt: skip
        policy = answer.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in policy and "script-src 'self'" in policy and "default-src 'self'" in policy
        assert answer.headers["x-frame-options"] == "DENY" and answer.headers["referrer-policy"] == "no-referrer"


def test_a_discarded_image_uploaded_again_is_discarded_again_and_undo_brings_it_back(
    tmp_path: Path, traffic: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, review = page(tmp_path, monkeypatch)
    root = tmp_path / "data" / "review"
    sha = traffic["a"]  # cat/, seed 0
    assert client.post("/api/discard", json={"items": [{"id": sha, "folder": "cat"}]}).status_code == 200
    first_sidecar = (root / ".discarded" / "cat" / f"{sha}.json").read_bytes()
    again = upload(root, {"cat": 0.48, "dog": 0.43, "bird": 0.09}, seed=0, saved_at="2025-06-01T10:00:00Z")
    assert again == sha and (root / "cat" / f"{sha}.png").is_file()

    answer = client.post("/api/discard", json={"items": [{"id": sha, "folder": "cat"}]})

    assert answer.status_code == 200, answer.text
    (line,) = answer.json()["entries"]
    assert line["what"] == "discard" and line["duplicate"] is True and line["sidecar"]["saved_at"].startswith("2025-06")
    assert not (root / "cat" / f"{sha}.png").exists() and not (root / "cat" / f"{sha}.json").exists()
    assert (root / ".discarded" / "cat" / f"{sha}.json").read_bytes() == first_sidecar  # the first copy, as it was
    assert sha not in {i["id"] for i in client.get("/api/items").json()["items"]}
    assert [e["what"] for e in log_lines(review.log.path)] == ["discard", "discard"]

    assert client.post("/api/undo", json={}).status_code == 200  # the second upload back, with its own sidecar
    assert (root / "cat" / f"{sha}.png").read_bytes() == (root / ".discarded" / "cat" / f"{sha}.png").read_bytes()
    assert '"2025-06-01T10:00:00Z"' in (root / "cat" / f"{sha}.json").read_text()
    assert (root / ".discarded" / "cat" / f"{sha}.json").read_bytes() == first_sidecar


@pytest.mark.fast
def test_what_a_killed_take_in_left_staged_goes_back_for_review(
    tmp_path: Path, traffic: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, review = page(tmp_path, monkeypatch)
    root = tmp_path / "data" / "review"
    before = review_files(root)
    dead, alive = root / ".take-in-99999999", root / f".take-in-{os.getppid()}"  # a page killed mid-merge; another
    for staging, name in ((dead, "a"), (alive, "b")):
        folder = next(root.glob(f"*/{traffic[name]}.png")).parent.name
        for suffix in (".png", ".json"):
            (staging / folder).mkdir(parents=True, exist_ok=True)
            os.replace(root / folder / f"{traffic[name]}{suffix}", staging / folder / f"{traffic[name]}{suffix}")
    assert len(client.get("/api/items").json()["items"]) == 3  # staged images are hidden

    assert restore_stale(review) == [traffic["a"]]

    assert not dead.exists() and alive.is_dir()  # a live page's take-in is its own
    shutil.rmtree(alive)
    assert review_files(root) == {k: v for k, v in before.items() if traffic["b"] not in k}


@pytest.mark.fast
def test_without_a_tracked_dataset_take_in_and_fix_answer_one_line_naming_add_data(
    tmp_path: Path, traffic: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    generated = tmp_path / "data" / "generated" / "circle" / "circle_00001.png"
    generated.parent.mkdir(parents=True)
    generated.write_bytes(png(99))
    sha = candidate(tmp_path / "data" / "review", generated, tmp_path, given="circle", suggested="dog")
    client, _ = page(tmp_path, monkeypatch)
    taken = client.post("/api/take-in", json={})
    assert taken.status_code == 409
    assert taken.json()["error"] == ("take-in: this page has no DVC-tracked dataset under data/raw/ (data.source is "
                                     "data/generated); make one with `make add-data SRC=data/generated NAME=shapes`, "
                                     "then `make review INTO=shapes`")  # fmt: skip
    fixed = client.post("/api/fix", json={"items": [{"id": sha, "folder": "dog"}]})
    error = fixed.json()["error"]
    assert fixed.status_code == 409 and "`make add-data SRC=data/generated NAME=shapes`" in error
    assert error.startswith("fix-in-place: data/generated/circle/circle_00001.png is not in a DVC-tracked dataset")
    assert generated.is_file() and (tmp_path / "data" / "review" / "dog" / f"{sha}.png").is_file()


def test_take_in_merges_the_labelled_images_and_ties_the_log_to_the_merge(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    review_dir, dest = repo / "data" / "review", repo / "data" / "raw" / "pets"
    probabilities = {"class_0": 0.45, "class_1": 0.35, "class_2": 0.2}
    shas = [upload(review_dir, probabilities, seed=s) for s in range(4)]
    duplicate = upload(review_dir, {"class_1": 0.4, "class_0": 0.3, "class_2": 0.3}, seed=9,
                       data=(dest / "class_1" / "class_1_001.png").read_bytes())  # fmt: skip
    client, review = page(repo, monkeypatch, load_params(repo / "params.yaml"))
    assert review.dataset is not None and review.log.path == Path("data/raw/pets.decisions.jsonl")
    items = {i["id"]: ref(i) for i in client.get("/api/items").json()["items"]}

    before = files(repo / "data")
    early = client.post("/api/take-in", json={})
    assert early.status_code == 409 and "none of the 5 image(s) has a decision yet" in early.json()["error"]
    assert files(repo / "data") == before
    client.post("/api/label", json={"items": [items[shas[0]], items[shas[1]]], "to": "class_2"})
    client.post("/api/label", json={"items": [items[shas[2]], items[duplicate]]})  # Enter: the model's guess
    client.post("/api/classes", json={"name": "hamster"})
    client.post("/api/label", json={"items": [items[shas[3]]], "to": "hamster"})
    suspect = candidate(review_dir, dest / "class_0" / "class_0_002.jpg", repo, given="class_0", suggested="class_1")
    client.post("/api/label", json={"items": [{"id": suspect, "folder": "class_1"}]})  # Enter: the suggestion
    late = upload(review_dir, probabilities, seed=7)  # the live server saves one more meanwhile: it waits
    log_before = review.log.path.read_bytes()

    answer = client.post("/api/take-in", json={})

    assert answer.status_code == 200, answer.text
    summary = answer.json()
    assert summary["added"] == 4 and summary["skipped"] == 1 and summary["classes_new"] == ["hamster"]
    assert summary["waiting"] == {"undecided": 1, "relabelled_candidates": 1}
    assert "1 image(s) with no decision yet and 1 relabelled label-error candidate(s) wait" in summary["said"][-1]
    assert summary["classes"]["class_2"] == {"added": 2, "skipped": 0} and sum(summary["splits"].values()) == 4
    assert summary["keep"] == ("git add data/raw/pets.dvc data/raw/pets.decisions.jsonl && git commit -m 'data: "
                               "pets: +4 reviewed images' && dvc push")  # fmt: skip
    assert any("4 added, 1 skipped" in line for line in summary["said"])
    assert (dest / "hamster" / f"{shas[3]}.png").is_file() and (dest / "class_2" / f"{shas[0]}.png").is_file()
    left = sorted(p.relative_to(review_dir).as_posix() for p in review_dir.rglob("*") if p.is_file())
    assert left == sorted([f"class_0/{late}.png", f"class_0/{late}.json", f"class_1/{suspect}.jpg",
                           f"class_1/{suspect}.json"])  # fmt: skip
    assert (dest / "class_0" / "class_0_002.jpg").is_file() and not list(dest.rglob(f"{suspect}.*"))
    merge = yaml.safe_load((repo / "data" / "raw" / "pets.dvc").read_text())["meta"]["merges"][-1]
    assert merge["decisions"] == {"entries": 6, "sha256": hashlib.sha256(log_before).hexdigest()}
    assert merge["from_review"] is True and merge["added"] == 4
    lines = log_lines(review.log.path)
    assert lines[-1]["what"] == "take-in" and sorted(lines[-1]["taken"]) == sorted([*shas, duplicate])
    assert review.log.path.read_bytes().startswith(log_before)  # append-only
    assert dvc("status", "--json", "data/raw/pets.dvc", cwd=repo).stdout.strip() in ("", "{}")
    undo = client.post("/api/undo", json={})
    assert undo.status_code == 409 and "'s take-in into data/raw/pets at " in undo.json()["error"]
    client.post("/api/discard", json={"items": [{"id": late, "folder": "class_0"}]})
    crossed = client.post("/api/take-in", json={})  # only the relabelled candidate is left: it cannot go in
    assert crossed.status_code == 409 and crossed.json()["error"].startswith(
        "take-in: 1 label-error candidate(s) relabelled "
        "(first: data/raw/pets/class_0/class_0_002.jpg, class_0 -> class_1); fix in place (f)"
    )


def test_take_in_while_a_dvc_repro_runs_a_stage_is_one_line_and_moves_nothing(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DVC lets go of its repository lock while a stage's command runs (make run's training): the take-in still
    sees it at work."""
    slow = repo / "slow"
    slow.mkdir()
    (slow / "dvc.yaml").write_text("stages:\n  slow:\n    cmd: python -c \"import time; open('started', 'w'); "
                                   "time.sleep(8); open('out.txt', 'w')\"\n    outs: [out.txt]\n")  # fmt: skip
    review_dir = repo / "data" / "review"
    sha = upload(review_dir, {"class_0": 0.4, "class_1": 0.35, "class_2": 0.25}, seed=3)
    client, review = page(repo, monkeypatch, load_params(repo / "params.yaml"))
    client.post("/api/label", json={"items": [{"id": sha, "folder": "class_0"}], "to": "class_1"})
    before = files(repo / "data")
    repro = subprocess.Popen([sys.executable, "-m", "dvc", "repro", "slow/dvc.yaml:slow"], cwd=repo,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (slow / "started").exists():
            assert repro.poll() is None and time.monotonic() < deadline, "the slow stage never started"
            time.sleep(0.1)
        answer = client.post("/api/take-in", json={})
        assert repro.poll() is None, "the stage ended before the take-in asked"
    finally:
        assert repro.wait(timeout=60) == 0
    assert answer.status_code == 409
    error = answer.json()["error"]
    assert error.startswith(f"take-in: DVC is at work (pid {repro.pid} (") and "repro" in error, error
    assert error.endswith("`make run` or another DVC command; try again when it is done, nothing was moved")
    assert "\n" not in error and files(repo / "data") == before
    assert client.post("/api/take-in", json={}).status_code == 200  # done: the same take-in goes through


def test_take_in_takes_only_the_images_checked_and_an_upload_saved_meanwhile_stays(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upload the server saves between the take-in's check and its merge has no decision: it stays in the review
    folder, is not in the dataset and is not logged as taken."""
    review_dir, dest = repo / "data" / "review", repo / "data" / "raw" / "pets"
    probabilities = {"class_0": 0.45, "class_1": 0.35, "class_2": 0.2}
    shas = [upload(review_dir, probabilities, seed=s) for s in range(2)]
    client, review = page(repo, monkeypatch, load_params(repo / "params.yaml"))
    client.post("/api/label", json={"items": [{"id": sha, "folder": "class_0"} for sha in shas]})
    late: list[str] = []

    def upload_then_merge(*args: Any, **kwargs: Any) -> Any:  # the server's upload lands right after the check
        late.append(upload(review_dir, probabilities, seed=7))
        return intake_merge(*args, **kwargs)

    monkeypatch.setattr("tasks.tools.review.intake.merge", upload_then_merge)
    answer = client.post("/api/take-in", json={})

    assert answer.status_code == 200, answer.text
    assert answer.json()["added"] == 2 and late
    assert all((dest / "class_0" / f"{sha}.png").is_file() for sha in shas)
    assert not list(dest.rglob(f"{late[0]}.*"))
    left = sorted(p.relative_to(review_dir).as_posix() for p in review_dir.rglob("*") if p.is_file())
    assert left == [f"class_0/{late[0]}.json", f"class_0/{late[0]}.png"]  # no staging folder left behind either
    line = log_lines(review.log.path)[-1]
    assert line["what"] == "take-in" and sorted(line["taken"]) == sorted(shas)
    assert any("data/review -> data/raw/pets: 2 added" in said for said in answer.json()["said"])
    merge = yaml.safe_load((repo / "data" / "raw" / "pets.dvc").read_text())["meta"]["merges"][-1]
    assert merge["from_review"] is True and merge["added"] == 2
    listed = client.get("/api/items").json()["items"]
    assert [(i["id"], i["decided"]) for i in listed] == [(late[0], None)]  # still to review


def test_a_take_in_the_merge_refuses_puts_every_image_back(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    review_dir, dest = repo / "data" / "review", repo / "data" / "raw" / "pets"
    shas = [upload(review_dir, {"class_0": 0.45, "class_1": 0.35, "class_2": 0.2}, seed=s) for s in range(3)]
    client, review = page(repo, monkeypatch, load_params(repo / "params.yaml"))
    client.post("/api/label", json={"items": [{"id": sha, "folder": "class_0"} for sha in shas], "to": "class_2"})
    (dest / "class_1" / "class_1_000.jpg").write_bytes(b"edited by hand")  # the merge refuses a changed dataset
    before, dvc_before = review_files(review_dir), (repo / "data" / "raw" / "pets.dvc").read_bytes()
    log_before = review.log.path.read_bytes()

    answer = client.post("/api/take-in", json={})

    assert answer.status_code == 409 and "data/raw/pets differs from data/raw/pets.dvc" in answer.json()["error"]
    assert review_files(review_dir) == before  # each image and sidecar back in its class folder, no staging left
    assert (repo / "data" / "raw" / "pets.dvc").read_bytes() == dvc_before
    assert not [p for sha in shas for p in dest.rglob(f"{sha}.*")]
    assert review.log.path.read_bytes() == log_before


def test_fix_in_place_moves_the_datasets_file_to_its_class_and_undo_puts_it_back(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    review_dir, dest = repo / "data" / "review", repo / "data" / "raw" / "pets"
    wrong = dest / "class_0" / "class_0_002.jpg"
    original = wrong.read_bytes()
    sha = candidate(review_dir, wrong, repo, given="class_0", suggested="class_1")
    dvc_before = (repo / "data" / "raw" / "pets.dvc").read_text()
    client, review = page(repo, monkeypatch, load_params(repo / "params.yaml"))
    item = client.get("/api/items").json()["items"][0]
    assert item["candidate"] and item["given"] == "class_0"
    assert client.get(item["file_url"]).content == original  # the dataset's own file, served beside its copy
    assert item["reason"].startswith("label-error candidate: the dataset says class_0")
    (dest / "class_2" / "class_2_000.jpg").write_bytes(b"edited by hand")  # the dataset differs from its .dvc file
    dirty = client.post("/api/fix", json={"items": [ref(item)]})
    assert dirty.status_code == 409 and dirty.json()["error"].startswith(
        "fix-in-place: data/raw/pets differs from data/raw/pets.dvc")  # fmt: skip
    assert wrong.is_file() and (review_dir / "class_1" / item["name"]).is_file()
    dvc("checkout", "-q", "--force", "data/raw/pets.dvc", cwd=repo)

    answer = client.post("/api/fix", json={"items": [ref(item)]})

    assert answer.status_code == 200, answer.text
    fixed = dest / "class_1" / "class_0_002.jpg"
    assert not wrong.exists() and fixed.read_bytes() == original
    assert (repo / "data" / "raw" / "pets.dvc").read_text() != dvc_before
    assert dvc("status", "--json", "data/raw/pets.dvc", cwd=repo).stdout.strip() in ("", "{}")
    assert not (review_dir / "class_1" / item["name"]).exists() and not list(review_dir.rglob(f"{sha}.json"))
    (entry,) = log_lines(review.log.path)
    assert entry["what"] == "fix-in-place" and entry["sha256"] == sha
    assert (entry["from"], entry["to"]) == (wrong.relative_to(repo).as_posix(), fixed.relative_to(repo).as_posix())
    assert answer.json()["keep"].startswith("git add data/raw/pets.dvc data/raw/pets.decisions.jsonl && git commit")
    assert "data/raw/pets.dvc" in sh(["git", "status", "--porcelain"], cwd=repo).stdout

    undone = client.post("/api/undo", json={})
    assert undone.status_code == 200, undone.text
    assert wrong.read_bytes() == original and not fixed.exists()
    assert (repo / "data" / "raw" / "pets.dvc").read_text() == dvc_before  # the same bytes: the same version
    assert (review_dir / "class_1" / item["name"]).read_bytes() == original
    assert [e["what"] for e in log_lines(review.log.path)] == ["fix-in-place", "undo"]


class FullDisk:
    """The os module as the decision log sees it on a full disk: opening the log to append fails."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    @staticmethod
    def open(*_: Any, **__: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_fix_in_place_and_its_undo_change_nothing_when_the_log_cannot_be_read_or_written(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    review_dir, dest = repo / "data" / "review", repo / "data" / "raw" / "pets"
    wrong, fixed = dest / "class_0" / "class_0_002.jpg", dest / "class_1" / "class_0_002.jpg"
    dvc_file = repo / "data" / "raw" / "pets.dvc"
    sha = candidate(review_dir, wrong, repo, given="class_0", suggested="class_1")
    client, review = page(repo, monkeypatch, load_params(repo / "params.yaml"))
    item = client.get("/api/items").json()["items"][0]
    copy = review_dir / "class_1" / item["name"]
    unfixed = (dvc_file.read_bytes(), files(review_dir))

    def unchanged(expected: tuple[bytes, dict[str, bytes]], where: Path) -> None:
        assert (dvc_file.read_bytes(), files(review_dir)) == expected and where.is_file()
        assert dvc("status", "--json", "data/raw/pets.dvc", cwd=repo).stdout.strip() in ("", "{}")

    review.log.path.write_text("{not json\n")  # a bad merge of the log, say
    corrupt = client.post("/api/fix", json={"items": [ref(item)]})
    assert corrupt.status_code == 409 and corrupt.json()["error"] == (
        "decision log data/raw/pets.decisions.jsonl line 1 is not JSON; restore it from git")  # fmt: skip
    unchanged(unfixed, wrong)
    review.log.path.unlink()
    with monkeypatch.context() as disk:
        disk.setattr(decisions, "os", FullDisk())
        with pytest.raises(OSError, match="No space left"):
            client.post("/api/fix", json={"items": [ref(item)]})
    unchanged(unfixed, wrong)  # the move and `dvc add` rolled back
    assert not fixed.exists() and copy.is_file() and not review.log.path.exists()

    assert client.post("/api/fix", json={"items": [ref(item)]}).status_code == 200
    done = (dvc_file.read_bytes(), files(review_dir))
    log_done = review.log.path.read_bytes()
    with monkeypatch.context() as disk:
        disk.setattr(decisions, "os", FullDisk())
        with pytest.raises(OSError, match="No space left"):
            client.post("/api/undo", json={})
    unchanged(done, fixed)  # still fixed: the file, the .dvc file, no copy back for review
    assert not wrong.exists() and not copy.exists() and review.log.path.read_bytes() == log_done
    assert client.post("/api/undo", json={}).status_code == 200
    unchanged(unfixed, wrong)
    assert [e["what"] for e in log_lines(review.log.path)] == ["fix-in-place", "undo"] and sha


def test_make_review_refuses_a_bad_into_in_one_line(repo: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "tasks.tools.review", "--into", "nope"], cwd=repo,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "[review] error: INTO nope: no dataset data/raw/nope; `make add-data SRC=data/review NAME=nope` makes a new "
        "one")  # fmt: skip
    shutil.rmtree(repo / "data" / "raw" / "pets")  # tracked, not pulled
    proc = subprocess.run([sys.executable, "-m", "tasks.tools.review", "--into", "pets"], cwd=repo,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "`dvc pull data/raw/pets.dvc` brings its images" in proc.stderr


def test_accept_runs_promote_accept_and_shows_its_exit_status(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No model in this project: promote refuses, and the page shows that command's output and status (the gate is
    not run after a failed promote); the refused accept is logged and undo passes over it."""
    sha = upload(repo / "data" / "review", {"class_0": 0.4, "class_1": 0.35, "class_2": 0.25}, seed=1)
    client, review = page(repo, monkeypatch, load_params(repo / "params.yaml"))
    client.post("/api/label", json={"items": [{"id": sha, "folder": "class_0"}], "to": "class_2"})
    empty = client.post("/api/accept", json={"reason": "  "})
    assert empty.status_code == 400 and empty.json()["error"].startswith("accept: the reason is empty")

    answer = client.post("/api/accept", json={"reason": "a class joined: the old baseline cannot score it"})

    assert answer.status_code == 200, answer.text
    (step,) = answer.json()["steps"]
    assert step["command"] == "python -m tasks.tools.promote --accept a class joined: the old baseline cannot score it"
    assert step["status"] == 2 and "[promote] error:" in step["output"] and answer.json()["ok"] is False
    assert [(e["what"], e.get("ok")) for e in log_lines(review.log.path)] == [("label", None), ("accept", False)]
    html = client.get("/").text  # one command: promote runs the gate itself
    assert 'python -m tasks.tools.promote --accept "&lt;reason&gt;"' in html and "check_regression" not in html
    assert client.post("/api/undo", json={}).json()["entries"][0]["undid"] == "label"
    assert (repo / "data" / "review" / "class_0" / f"{sha}.png").is_file()
