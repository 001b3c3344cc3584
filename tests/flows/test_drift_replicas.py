"""Replicas as one (flows/drift_replicas.py, regression.drift_urls): the nightly merges the window counts of
every replica's /drift and computes PSI on them, as one window fed all their traffic would; a replica that does
not answer is named and the night counts as unread. The reports come from real drift windows
(tasks/release/drift.py), served by real HTTP servers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from flows.drift_replicas import merge
from tasks.release.drift import DriftWindow
from tasks.release.drift_thresholds import DriftThresholds
from tests.helpers.drift import CLASSES, DriftServer, confident, feed, nightly, reference_of
from tests.helpers.prefect import api_artifacts, free_port
from tests.helpers.project import write_params

THRESHOLDS = DriftThresholds.fixed(window=500, min_predictions=200, value=0.25)
MODEL = {"sha256": "ab" * 32, "source": "production", "version": "production-abab"}


def window_report(seed: int, n: int, classes: list[int]) -> dict:
    """A /drift report of a window fed `n` predictions leaning to `classes`, as a replica answers it."""
    rng = np.random.default_rng(0)
    window = DriftWindow(CLASSES, reference_of(confident(rng, 1000, list(rng.integers(0, 4, 1000)))), THRESHOLDS)
    feed(window, confident(np.random.default_rng(seed), n, classes))
    return json.loads(json.dumps({"model": MODEL, "scope": "the server", **window.report()}))


def test_merged_counts_judge_the_replicas_as_one_window_would() -> None:
    """Two replicas of 150 predictions each: alone each says 'not enough data'; merged, their 300 lean to one
    class and the PSI is the one a single window fed both streams gives."""
    lean = [0] * 3 + [1, 2, 3]
    one, two = window_report(1, 150, lean * 25), window_report(2, 150, lean * 25)
    assert one["verdict"] == two["verdict"] == "not enough data"
    merged = merge([("http://a:1", one), ("http://b:2", two)], [])
    rng = np.random.default_rng(0)
    alone = DriftWindow(CLASSES, reference_of(confident(rng, 1000, list(rng.integers(0, 4, 1000)))), THRESHOLDS)
    for seed in (1, 2):
        feed(alone, confident(np.random.default_rng(seed), 150, lean * 25))
    want = alone.report()
    assert merged["verdict"] == want["verdict"] == "drift" and merged["window"]["filled"] == 300
    for name, statistic in want["statistics"].items():
        assert merged["statistics"][name]["value"] == pytest.approx(statistic["value"], abs=1e-4), name
    assert merged["moved_most"][0]["class"] == "cat" and merged["unreadable"] == []


def test_one_replica_merged_is_judged_exactly_as_its_server_judged_it() -> None:
    """The merge holds the summed window to the server's own rule (DriftThresholds.judge): for one replica, every
    statistic's value, threshold, recover level, curve and source and the verdict are the server's."""
    for classes in ([0, 1, 2, 3] * 75, [0] * 300):
        one = window_report(3, 300, classes)
        merged = merge([("http://a:1", one)], [])
        assert merged["statistics"] == one["statistics"] and merged["verdict"] == one["verdict"], classes


def test_a_replica_serving_another_model_is_left_out_and_named() -> None:
    one, two = window_report(1, 300, [0, 1, 2, 3] * 75), window_report(2, 300, [0, 1, 2, 3] * 75)
    other = {**two, "model": {**MODEL, "sha256": "cd" * 32}}
    merged = merge([("http://a:1", one), ("http://b:2", other), ("http://c:3", one)], [])
    assert [r["url"] for r in merged["replicas"]] == ["http://a:1", "http://c:3"]
    assert merged["unreadable"][0]["url"] == "http://b:2" and "cdcd" in merged["unreadable"][0]["why"]


def test_the_nightly_merges_replicas_names_one_down_and_counts_the_night_unread(
    drift_server: DriftServer,
    tmp_path: Path,
    prefect_api: None,
) -> None:
    """regression.drift_urls: a replica that answers with a drifting window, and one where nothing listens. The
    night ends in Drift on the merged verdict; the artifact names the replica down; with drift that is fine, the
    next night ends in DriftUnread (drift_unreadable_nights 1) naming it."""
    from flows.drift import FIGURE_KEY

    down = f"http://127.0.0.1:{free_port()}"
    write_params(tmp_path, {"regression": {"drift_urls": [drift_server.url, down], "drift_unreadable_nights": 1}})
    drift_server.report = window_report(1, 400, [0] * 300 + [1, 2, 3] * 33 + [1])
    state = nightly(tmp_path)
    assert state.is_failed() and state.name == "Drift", (state.name, state.message)
    figure = api_artifacts(state.state_details.flow_run_id)[FIGURE_KEY]
    assert f"replica {down} NOT READ" in figure.data and "1 replicas judged as one" in figure.data

    drift_server.report = window_report(2, 400, [0, 1, 2, 3] * 100)
    state = nightly(tmp_path)
    assert state.is_failed() and state.name == "DriftUnread", (state.name, state.message)
    assert f"replica {down} left out" in state.message, state.message
