"""The review folder's one definition of an image (tasks/images/review_folder.py) as the page, the server's count
and the take-in read it: ids by content, sidecars that belong to their image, existing class names accepted,
decision ids under a lock, accept beside labelling."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from serving.review_store import ReviewFolder
from tasks.core.io import sha256_bytes
from tasks.core.params import Params, load_params
from tasks.images.review_folder import count
from tasks.tools.review import accept as accept_module
from tasks.tools.review.decisions import DecisionLog
from tests.helpers.folders import make_imagefolder
from tests.helpers.review import log_lines, page, png, upload


def test_two_images_of_one_name_in_two_classes_are_two_cards_labelled_undone_and_taken_in(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    review_dir, dest = repo / "data" / "review", repo / "data" / "raw" / "pets"
    for cls, seed in (("class_0", 1), ("class_1", 2)):  # put there by hand: a camera's names, no sidecar
        (review_dir / cls).mkdir(parents=True, exist_ok=True)
        (review_dir / cls / "IMG_1.jpg").write_bytes(png(seed))
    (review_dir / "class_1" / "class_1_001.png").write_bytes(png(3))  # the dataset has this name, other bytes
    shas = {name: sha256_bytes(png(seed)) for name, seed in (("cat", 1), ("dog", 2), ("clash", 3))}
    client, review = page(repo, monkeypatch, load_params(repo / "params.yaml"))
    items = client.get("/api/items").json()["items"]
    assert sorted(i["id"] for i in items) == sorted(shas.values())  # three cards, ids by content

    moved = client.post("/api/label", json={"items": [{"id": shas["cat"], "folder": "class_0"}], "to": "class_1"})
    assert moved.status_code == 200, moved.text
    renamed = f"IMG_1-{shas['cat'][:12]}.jpg"  # class_1 has an IMG_1.jpg of its own: both kept
    assert (review_dir / "class_1" / "IMG_1.jpg").read_bytes() == png(2)
    assert (review_dir / "class_1" / renamed).read_bytes() == png(1)
    assert client.post("/api/undo", json={}).status_code == 200  # back under its own name
    assert (review_dir / "class_0" / "IMG_1.jpg").read_bytes() == png(1) and not (
        review_dir / "class_1" / renamed
    ).exists()
    client.post("/api/label", json={"items": [{"id": shas["cat"], "folder": "class_0"}], "to": "class_1"})
    both = [{"id": shas["dog"], "folder": "class_1"}, {"id": shas["clash"], "folder": "class_1"}]
    client.post("/api/label", json={"items": both, "to": "class_1"})
    decided = {i["id"]: i["decided"] for i in client.get("/api/items").json()["items"]}
    assert all(decided[sha] is not None for sha in shas.values()), decided  # labelling one left the other decided

    answer = client.post("/api/take-in", json={})

    assert answer.status_code == 200, answer.text
    assert answer.json()["added"] == 3 and answer.json()["waiting"] == {"undecided": 0, "relabelled_candidates": 0}
    assert (dest / "class_1" / "IMG_1.jpg").read_bytes() == png(2) and (dest / "class_1" / renamed).read_bytes() == png(
        1
    )
    assert (dest / "class_1" / f"class_1_001-{shas['clash'][:12]}.png").read_bytes() == png(3)
    assert count(review_dir) == 0


def test_a_sidecar_belongs_to_the_image_whose_sha256_it_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    review_dir = tmp_path / "data" / "review"
    sha = upload(review_dir, {"cat": 0.4, "dog": 0.35, "bird": 0.25}, seed=1)
    (review_dir / "cat" / f"{sha}.png").rename(review_dir / "cat" / "IMG_2.png")
    (review_dir / "cat" / f"{sha}.json").rename(review_dir / "cat" / "IMG_2.json")
    (review_dir / "cat" / "IMG_2.jpg").write_bytes(png(5))  # by hand, the same stem, no sidecar of its own
    other = sha256_bytes(png(5))
    client, _ = page(tmp_path, monkeypatch)
    cards = {i["id"]: i for i in client.get("/api/items").json()["items"]}
    assert cards[sha]["guess"] == "cat" and cards[sha]["reason"].startswith("low confidence: top-1 0.40")
    assert cards[other]["guess"] is None and cards[other]["reason"] == "no sidecar: put here by hand"

    answer = client.post("/api/label", json={"items": [{"id": other, "folder": "cat"}], "to": "dog"})

    assert answer.status_code == 200, answer.text
    assert json.loads((review_dir / "cat" / "IMG_2.json").read_text())["sha256"] == sha  # stayed with its image
    assert sorted(p.name for p in (review_dir / "dog").iterdir()) == ["IMG_2.jpg"]


def test_a_datasets_own_long_class_names_are_accepted_and_a_new_one_is_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """iNaturalist's class names are 70-90 characters: the dataset's own classes are classes, whatever their
    length; a new name typed on the page is checked as a folder name."""
    source = make_imagefolder(tmp_path / "inat", classes=2, per_class=3)
    long_names = ["Plantae Tracheophyta Magnoliopsida Asterales Asteraceae Symphyotrichum novae-angliae " + s
                  for s in ("a", "b")]  # fmt: skip
    for folder, name in zip(sorted(source.iterdir()), long_names, strict=True):
        folder.rename(source / name)
    review_dir = tmp_path / "data" / "review"
    sha = upload(review_dir, {"cat": 0.4, "dog": 0.35, "bird": 0.25}, seed=1)
    params = Params().model_copy(update={"data": Params().data.model_copy(update={"source": source})})
    client, _ = page(tmp_path, monkeypatch, params)
    assert [c["name"] for c in client.get("/api/items").json()["classes"]][:2] == long_names

    answer = client.post("/api/label", json={"items": [{"id": sha, "folder": "cat"}], "to": long_names[1]})

    assert answer.status_code == 200, answer.text
    assert (review_dir / long_names[1] / f"{sha}.png").is_file()
    refused = client.post("/api/classes", json={"name": "x" * 300})
    assert refused.status_code == 400 and "is 300 bytes long" in refused.json()["error"]


def test_the_server_counts_what_the_page_lists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One definition: an image deeper than <class>/<image>, a hidden file or a hidden folder's is not one to
    review, for the server's count as for the page."""
    review_dir = tmp_path / "data" / "review"
    for seed in range(3):
        upload(review_dir, {"cat": 0.4, "dog": 0.35, "bird": 0.25}, seed=seed)
    (review_dir / "cat" / "deeper").mkdir()
    (review_dir / "cat" / "deeper" / "a.png").write_bytes(png(7))
    (review_dir / "cat" / ".b.png").write_bytes(png(8))
    (review_dir / ".discarded" / "cat").mkdir(parents=True)
    (review_dir / ".discarded" / "cat" / "c.png").write_bytes(png(9))
    client, _ = page(tmp_path, monkeypatch)
    listed = client.get("/api/items").json()["items"]
    assert len(listed) == 3 and ReviewFolder(review_dir, 10, 10**6).count == 3 == count(review_dir)


def test_decision_ids_are_given_under_the_log_files_lock(tmp_path: Path) -> None:
    """Two pages (or a planned batch written after another's) never give two lines one id."""
    one, two = DecisionLog(tmp_path / "log.jsonl", "a"), DecisionLog(tmp_path / "log.jsonl", "b")
    first = one.plan([{"what": "label", "sha256": "1" * 64}, {"what": "label", "sha256": "2" * 64}])
    second = two.plan([{"what": "discard", "sha256": "3" * 64}])  # planned before the first was written
    one.write(first)
    written = two.write(second)
    barrier = threading.Barrier(8)

    def write(i: int) -> None:
        log = DecisionLog(tmp_path / "log.jsonl", f"w{i}")
        planned = log.plan([{"what": "label", "sha256": f"{i:064d}"}] * 3)
        barrier.wait()
        log.write(planned)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines = log_lines(tmp_path / "log.jsonl")
    assert written[0]["id"] == 3 and written[0]["batch"] == 3
    assert [e["id"] for e in lines] == list(range(1, 28))
    for batch in {e["batch"] for e in lines}:
        members = [e for e in lines if e["batch"] == batch]
        assert len({e["who"] for e in members}) == 1 and members[0]["id"] == batch


def test_labelling_goes_on_while_an_accept_runs_and_a_second_accept_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    review_dir = tmp_path / "data" / "review"
    sha = upload(review_dir, {"cat": 0.4, "dog": 0.35, "bird": 0.25}, seed=1)
    started = threading.Event()

    def slow_promote(review: object, args: list[str]) -> dict[str, object]:  # promote's gate: minutes
        started.set()
        time.sleep(3)
        return {"command": " ".join(args), "status": 0, "output": "promoted"}

    monkeypatch.setattr(accept_module, "_run", slow_promote)
    client, review = page(tmp_path, monkeypatch)
    result: dict[str, object] = {}
    thread = threading.Thread(target=lambda: result.update(client.post("/api/accept", json={"reason": "ok"}).json()))
    thread.start()
    assert started.wait(10)
    t0 = time.monotonic()
    labelled = client.post("/api/label", json={"items": [{"id": sha, "folder": "cat"}], "to": "dog"})
    took = time.monotonic() - t0
    second = client.post("/api/accept", json={"reason": "again"})
    thread.join()
    assert labelled.status_code == 200 and took < 2.5, (labelled.text, took)
    assert second.status_code == 409 and "another accept is running" in second.json()["error"]
    assert result["ok"] is True
    assert [e["what"] for e in log_lines(review.log.path)] == ["label", "accept"]
