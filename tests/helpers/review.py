"""Review folders written as their writers write them (the server's low-confidence uploads, make
review-label-errors' candidates), a DVC-tracked dataset to take them into, and the review page as
`make review` starts it: no trained model needed."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from tasks.core.io import sha256_bytes, sha256_file
from tasks.core.params import Params
from tasks.tools.review.app import create_app
from tasks.tools.review.state import Review, open_review
from tests.helpers.folders import make_imagefolder
from tests.helpers.prefect import free_port
from tests.helpers.project import ROOT, commit, env_with_venv, make_command, make_project


def png(seed: int, side: int = 24) -> bytes:
    pixels = (np.random.default_rng(seed).random((side, side, 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def upload(review: Path, probabilities: dict[str, float], *, seed: int, saved_at: str = "2025-05-01T10:00:00Z",
           data: bytes | None = None) -> str:  # fmt: skip
    """A low-confidence upload as serving's ReviewFolder saves it: <predicted>/<sha256>.png + <sha256>.json
    (the sidecar first); returns the sha256."""
    data = png(seed) if data is None else data
    sha = sha256_bytes(data)
    ranked = sorted(probabilities.items(), key=lambda cp: -cp[1])
    predicted, top1 = ranked[0]
    folder = review / predicted
    folder.mkdir(parents=True, exist_ok=True)
    sidecar = {"file": f"upload-{seed}.png", "sha256": sha, "model_sha256": "0" * 64, "predicted": predicted,
               "top1_probability": top1, "margin": top1 - ranked[1][1], "probabilities": probabilities,
               "saved_at": saved_at}  # fmt: skip
    (folder / f"{sha}.json").write_text(json.dumps(sidecar, indent=2))
    (folder / f"{sha}.png").write_bytes(data)
    return sha


def candidate(review: Path, file: Path, repo: Path, *, given: str, suggested: str, rank: int = 1) -> str:
    """A label-error candidate as `make review-label-errors` copies it: <suggested>/<sha256><ext> with the
    label_errors.json entry (file relative to the project) plus source and saved_at; returns the sha256."""
    sha = sha256_file(file)
    folder = review / suggested
    folder.mkdir(parents=True, exist_ok=True)
    entry = {"file": file.relative_to(repo).as_posix(), "given": given, "p_given": 0.02, "p_predicted": 0.91,
             "p_suggested": 0.91, "predicted": suggested, "rank": rank, "score": -4.2, "scored_by": "final model",
             "sha256": sha, "split": "train", "suggested": suggested, "source": "label_errors",
             "saved_at": "2025-05-02T09:00:00Z"}  # fmt: skip
    (folder / f"{sha}.json").write_text(json.dumps(entry, indent=2))
    shutil.copyfile(file, folder / f"{sha}{file.suffix.lower()}")
    return sha


def tracked_project(root: Path, classes: int = 3, per_class: int = 4) -> Path:
    """A project (git + DVC) whose data.source is data/raw/pets (class_<c>/class_<c>_<i>.jpg|png), `make add-data`ed
    and committed."""
    repo = make_project(root / "repo")
    shutil.copy2(ROOT / "params.yaml", repo / "params.yaml")
    src = make_imagefolder(root / "pets", classes=classes, per_class=per_class)
    for path in sorted(src.rglob("*.*")):  # class_0/class_0_000.jpg: names unique across classes, as most datasets
        path.rename(path.with_name(f"{path.parent.name}_{path.name}"))
    proc = subprocess.run(make_command("add-data", f"SRC={src}", "NAME=pets"), cwd=repo, env=env_with_venv(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    commit(repo, "pets")
    return repo


def log_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def set_review_port(repo: Path, port: int) -> None:
    text = (repo / "params.yaml").read_text()
    assert "review_port: 8010" in text
    (repo / "params.yaml").write_text(text.replace("review_port: 8010", f"review_port: {port}"))


@contextmanager
def review_page(repo: Path, *args: str) -> Iterator[tuple[str, Path]]:
    """`make review ARGS` in `repo` on a free port (written into its params.yaml), once its URL is printed and
    answers: that URL (with the token every request needs) and the file its output goes to."""
    port = free_port()
    set_review_port(repo, port)
    output = repo.parent / "make-review.log"
    with output.open("w") as sink:
        proc = subprocess.Popen(make_command("review", *args), cwd=repo, env=env_with_venv(), stdout=sink,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    printed = re.compile(rf"the review page: (http://127\.0\.0\.1:{port}/[\w-]+/\?token=[\w-]+) \(Ctrl-C stops it\)")
    try:
        deadline = time.monotonic() + 60
        while True:
            found = printed.search(output.read_text())
            try:  # the token URL answers with its cookie and a redirect to the page
                if found and httpx.get(found.group(1), timeout=2).status_code == 303:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, f"make review exited: {output.read_text()}"
            assert time.monotonic() < deadline, f"the review page did not answer within 60 s: {output.read_text()}"
            time.sleep(0.2)
        yield found.group(1), output
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C: make and the page it started
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def page(root: Path, monkeypatch: pytest.MonkeyPatch, params: Params | None = None,
         into: str | None = None) -> tuple[TestClient, Review]:  # fmt: skip
    """The page as `make review` builds it, run from `root` (the project's folder), opened as a person opens it:
    through the URL with the token, whose cookie the client keeps."""
    monkeypatch.chdir(root)
    review = open_review(params or Params(), into, root)
    app = create_app(review)
    client = TestClient(app, base_url=f"http://127.0.0.1{app.state.base}")  # "/api/items" is <base>api/items
    entry = client.get(f"/?token={app.state.token}", follow_redirects=False)
    assert entry.status_code == 303 and entry.headers["location"] == app.state.base, entry.text
    assert client.cookies.get("imagepipe_review") == app.state.token
    return client, review


def files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def review_files(review: Path) -> dict[str, bytes]:
    """The review folder without the log (which grows by design)."""
    return {k: v for k, v in files(review).items() if k != ".decisions.jsonl"}


def ref(item: dict[str, str]) -> dict[str, str]:
    return {"id": item["id"], "folder": item["folder"]}
