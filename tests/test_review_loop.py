"""Week two through the review page (issue 49): a served model gets inputs of a class it does not know; the page
lists them; a person names the new class, labels one by keyboard and the rest as a range, and takes them in;
`make run` fails (the classes changed), the page's accept promotes the run with a recorded reason, the server
reloads it, and `make run` passes against the new baseline.

Everything is real: a git + DVC copy of the project driven by the Makefile, uvicorn from the torch-free serving
venv, `make review` in headless chromium (Debian's, launched by path through playwright).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import yaml

from tasks.core.params import load_params
from tests.helpers.folders import make_imagefolder
from tests.helpers.project import ROOT, commit, env_with_venv, make_command, make_project
from tests.helpers.review import review_page
from tests.helpers.serving import post_reload, running_server

pytestmark = pytest.mark.slow  # about 3 min on 2 cores: three tiny runs, a server, a browser
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright drives the browser of this test")
CHROMIUM = "/usr/bin/chromium"  # `playwright install` cannot download here: apt-get install -y chromium
NAME, NEW, SENT = "colours", "class_3", 24
REASON = "class_3 joined: its images were labelled on the review page"
PARAMS = {"train": {"epochs": 6}, "export": {"formats": ["onnx"]},
          "serve": {"drift": {"window": 40, "min_predictions": 20, "false_alarm_rate": 0.01}}}  # fmt: skip


def make(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(make_command(*args), cwd=repo, env=env_with_venv(), capture_output=True, text=True,
                          timeout=900)  # fmt: skip


def ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, f"{proc.args}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_a_new_class_labelled_on_the_page_is_taken_in_accepted_and_served(tmp_path: Path) -> None:
    repo = make_project(tmp_path / "repo", PARAMS)
    shutil.copy2(ROOT / ".gitignore", repo / ".gitignore")  # runs/ and data/review/ stay out of git
    subprocess.run(["git", "config", "user.name", "Grace Hopper"], cwd=repo, check=True)
    ok(make(repo, "add-data", f"SRC={make_imagefolder(tmp_path / 'images', classes=3, per_class=40)}", f"NAME={NAME}"))
    ok(make(repo, "run"))
    ok(make(repo, "promote"))
    commit(repo, "three colours, promoted")
    first_sha = json.loads((repo / "baseline" / "model.json").read_text())["onnx_sha256"]

    params = load_params(repo / "params.yaml")
    review = repo / params.serve.review_dir
    traffic = sorted((make_imagefolder(tmp_path / "traffic", classes=4, per_class=SENT, seed=7) / NEW).iterdir())
    expect = sync_api.expect
    requests: list[str] = []
    with running_server(repo, review, low_confidence=1.0, drift=params.serve.drift) as (url, _):
        with httpx.Client(timeout=30) as client:  # one class the model has never seen: all of it kept for review
            for path in traffic:
                answer = client.post(f"{url}/predict", content=path.read_bytes(),
                                     headers={"content-type": "application/octet-stream"})  # fmt: skip
                assert answer.status_code == 200, answer.text
        assert len(list(review.rglob("*.png")) + list(review.rglob("*.jpg"))) == SENT

        with review_page(repo) as (page_url, _), sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("request", lambda request: requests.append(request.url))
            assert "/?token=" in page_url  # the URL make review printed: its token becomes the page's cookie
            page.goto(page_url)
            assert page.url == page_url.split("?")[0]
            cards = page.locator(".card")
            expect(cards).to_have_count(SENT)  # the page lists every input, each with the model's guess
            assert all(t.startswith("guess class_") for t in page.locator(".card .guess").all_inner_texts())

            page.keyboard.press("n")  # a class the dataset does not have yet, named on the page
            page.keyboard.type(NEW)
            page.keyboard.press("Enter")
            expect(page.locator("#message")).to_have_text(f"class {NEW} added: key 4")
            page.keyboard.press("4")  # one image by keyboard
            expect(page.locator("#message")).to_have_text(f"1 image(s) filed under {NEW}")
            cards.nth(1).click()  # the rest as one range
            cards.nth(SENT - 1).click(modifiers=["Shift"])
            page.keyboard.press("4")
            expect(page.locator("#message")).to_have_text(f"{SENT - 1} image(s) filed under {NEW}")

            page.locator("#take-in-button").click()
            expect(page.locator("#take-in-result")).to_contain_text(f"new classes: {NEW}", timeout=120_000)
            expect(page.locator("#take-in-result")).to_contain_text(f"{SENT} added, 0 skipped")
            dataset = repo / "data" / "raw" / NAME
            assert len(list((dataset / NEW).iterdir())) == SENT
            merge = yaml.safe_load((dataset.with_name(f"{NAME}.dvc")).read_text())["meta"]["merges"][-1]
            assert merge["classes_new"] == [NEW] and merge["decisions"]["entries"] >= SENT
            commit(repo, f"data: {NEW} from the review page")

            failed = make(repo, "run")  # the classes changed: the gate cannot compare, and says what leads out
            assert failed.returncode != 0 and 'make promote ACCEPT="<why>"' in failed.stderr, failed.stderr[-2000:]

            page.reload()
            page.locator("#accept-reason").fill(REASON)
            page.locator("#accept-form button").click()
            expect(page.locator("#message")).to_have_text("accepted: the baseline is promoted and the gate ran again",
                                                          timeout=300_000)  # fmt: skip
            browser.close()
        assert requests and all(urlparse(u).hostname == "127.0.0.1" for u in requests), requests

        decision = json.loads((repo / "baseline" / "decision.json").read_text())
        assert decision["reason"] == REASON and decision["by"] == "Grace Hopper"
        assert decision["set_aside"]["verdict"] == "different test set"
        new_sha = json.loads((repo / "baseline" / "model.json").read_text())["onnx_sha256"]
        assert new_sha != first_sha and NEW in json.loads((repo / "baseline" / "model.json").read_text())["class_names"]
        reloaded = post_reload(repo, url)
        assert reloaded.status_code == 200 and reloaded.json()["status"] == "reloaded", reloaded.text
        assert httpx.get(f"{url}/ready").json()["model"]["sha256"] == new_sha  # the served hash changed

    ok(make(repo, "run"))  # against the 4-class baseline now
    assert json.loads((repo / "reports" / "gate.json").read_text())["verdict"] == "pass"
