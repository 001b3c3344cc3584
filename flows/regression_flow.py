"""regression-flow (deployment `nightly`): the production ONNX model, re-scored on the fixed test set,
and the served model's drift.

production model (the promoted baseline's ONNX, or paths.onnx at a git revision) + test shards
-> metrics -> compared with baseline/metrics.json under params.yaml's regression rules -> a verdict
artifact; the run fails when the model file's hash differs from the recorded one or when it regressed.
With `server` (a checked URL, flows/drift.py), the server's GET /drift -> a table and a figure artifact;
the server's verdict drift (and no regression, or no baseline to check) ends the run in a Failed state named
"Drift", which the drift automation (flows/automations.py) reacts to. A server that cannot be read costs one
line, not the check, until regression.drift_unreadable_nights runs in a row could not read it: that run ends
Failed, named "DriftUnread", which the drift automation reacts to as well. A regression outranks both: the
run fails as a regression, drift named in its message.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Collection
from pathlib import Path
from typing import Any

import dvc.api
from prefect import flow, get_run_logger, runtime, task
from prefect.states import Failed, State

from flows.artifacts import publish_integrity_failure, publish_nightly, publish_no_baseline
from flows.drift import (
    DRIFT_STATE,
    DRIFT_UNREAD_STATE,
    DriftUnavailable,
    checked_server,
    publish_drift,
    publish_unavailable,
    read_drift,
    summary,
    unread_message,
    unread_nights,
)
from flows.drift_replicas import merge, read_replicas
from flows.shell import flow_run_url, refuse_overriding_env
from tasks.core.params import PARAMS_FILE, Params, load_params
from tasks.core.paths import BASELINE_METRICS
from tasks.release import tracking
from tasks.release.inference import ModelIntegrityError
from tasks.release.production import (
    ProductionModel,
    ProductionModelError,
    load_baseline,
    load_promoted_test_set,
    promoted_model,
)
from tasks.release.scoring import score_promoted_set, score_split
from tasks.release.verdict import compare
from tasks.release.verdict_table import format_table

REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./~^-]*")  # a name git and DVC take as a revision, never an option


class RegressionFound(RuntimeError):
    """The production model scores worse than the baseline beyond a rule's tolerance."""


def _promoted_model(repo: Path, params: Params) -> ProductionModel:
    model = promoted_model(params.paths, repo)
    if model is None:
        raise ProductionModelError(f"{repo / params.paths.baseline_onnx}: no promoted model here; make promote")
    return model


def _model_at_revision(repo: Path, params: Params, revision: str, scratch: Path) -> ProductionModel:
    """paths.onnx as of a git revision (from the DVC cache), with the hash its export stage recorded."""
    report = params.paths.export_report
    if not REVISION.fullmatch(revision):
        raise ValueError(f"revision {revision!r} is not a commit, branch or tag name")
    try:
        expected = json.loads(dvc.api.read(str(report), repo=str(repo), rev=revision))["onnx_sha256"]
        data = dvc.api.read(str(params.paths.onnx), repo=str(repo), rev=revision, mode="rb")
    except Exception as exc:  # dvc raises several types for a bad revision or a missing file
        raise FileNotFoundError(f"revision {revision!r}: cannot read {params.paths.onnx} or {report}: {exc}") from exc
    path = scratch / params.paths.onnx.name
    path.write_bytes(data)
    return ProductionModel(path, expected, "revision", f"{params.paths.onnx} at {revision}, hash recorded in {report}")


@task(name="score-production-model", cache_policy=None)
def score(model: ProductionModel, shard_dir: Path, batch_size: int, promoted: Collection[str] | None = None
          ) -> dict[str, Any]:  # fmt: skip
    """The file's hash is checked before onnxruntime reads it; then the fixed test set is scored: the test images
    that were promoted with the model (baseline/test_set.json), so images that joined the test split since (make
    add-data INTO=...) leave the comparison with its promoted metrics as it was; the whole test split for a
    baseline promoted before that record."""
    loaded = model.load()
    if promoted is None:
        return score_split(loaded, shard_dir, "test", batch_size)
    return score_promoted_set(loaded, shard_dir, promoted, batch_size)


@task(name="read-server-drift", cache_policy=None)
def server_drift(base: str) -> tuple[dict[str, Any] | None, str]:
    """GET <server>/drift and its artifacts: (the report, "") or, when unreadable, (None, why) with one line in
    the log and the NOT READ artifact."""
    logger = get_run_logger()
    try:
        report = read_drift(base)
    except DriftUnavailable as exc:
        logger.warning("drift not read: %s; the regression check runs without it", exc)
        publish_unavailable(base, str(exc))
        return None, str(exc)
    publish_drift(base, report)
    logger.info("drift of %s: %s", base, summary(report))
    return report, ""


def replicas_drift(label: str, bases: list[str]) -> tuple[dict[str, Any] | None, str]:
    """Every replica's /drift merged into one report and its artifacts (flows/drift_replicas.py): (the report,
    why any replica was left out, or "") or, when none could be merged, (None, why) and the NOT READ artifact."""
    logger = get_run_logger()
    read, unreadable = read_replicas(bases)
    try:
        report = merge(read, unreadable)
    except DriftUnavailable as exc:
        logger.warning("drift not read: %s; the regression check runs without it", exc)
        publish_unavailable(label, str(exc))
        return None, str(exc)
    publish_drift(label, report)
    why = "; ".join(f"replica {u['url']} left out: {u['why']}" for u in report["unreadable"])
    logger.info("drift of %s: %s%s", label, summary(report), f"; {why}" if why else "")
    return report, why


def _drift_attention(base: str | None, drift: dict[str, Any] | None, unread: str | None, checked: str) -> State | None:
    """The state a run whose regression check did not fail ends in when the server's drift needs attention (None:
    it does not): Drift on the server's verdict drift, DriftUnread on `unread`; `checked` says what the regression
    check found."""
    if drift is not None and drift["verdict"] == "drift":
        # Not Completed: the UI shows it red, by this name, and the drift automation reacts to it.
        return Failed(name=DRIFT_STATE, message=f"drift of {base}: {summary(drift)}; {checked}")
    if unread is not None:
        return Failed(name=DRIFT_UNREAD_STATE, message=f"{unread}; {checked}")
    return None


@flow(name="regression-flow", log_prints=True)
def regression_flow(revision: str | None = None, server: str | None = None) -> dict[str, Any] | State:
    """Score the production model on the fixed test set and compare it with the promoted baseline.

    `revision` (a git commit, branch or tag) scores paths.onnx as of that revision instead of the
    promoted model; its expected hash is then the one its export stage recorded. `server`
    (http://127.0.0.1:8000, or a URL listed in params.yaml regression.drift_servers) is read for drift.
    It runs in the checkout its deployment names (the working directory).
    """
    refuse_overriding_env("regression-flow")
    logger = get_run_logger()
    repo = Path.cwd()
    params = load_params(repo / PARAMS_FILE)
    regression = params.regression
    allowed = (*regression.drift_servers, *regression.drift_urls)
    bases = [checked_server(url, allowed) for url in ([server] if server else regression.drift_urls)]
    base = bases[0] if len(bases) == 1 else f"replicas {', '.join(bases)}" if bases else None
    drift, why = (server_drift(base) if len(bases) == 1 else replicas_drift(base, bases)) if base else (None, "")
    drifted = drift is not None and drift["verdict"] == "drift"
    unread = None  # the DriftUnread message, once the server went unread on drift_unreadable_nights runs in a row
    if base is not None and (drift is None or drift.get("unreadable")):
        nights = unread_nights(base, allowed, regression.drift_unreadable_nights, server)
        logger.info("drift of %s not read on %d run(s) in a row (DriftUnread at %d)", base, nights,
                    regression.drift_unreadable_nights)  # fmt: skip
        if nights >= regression.drift_unreadable_nights:
            unread = unread_message(base, nights, why)
    baseline = load_baseline(repo / params.paths.baseline)
    if baseline is None:
        # Not a crash: nothing was promoted yet. The run says so as its state message and artifact; drift (or a
        # server long unread) still ends it in the state the drift automation reacts to, the note in its message.
        message = (f"no baseline yet: nothing to check ({repo / params.paths.baseline / BASELINE_METRICS} is absent); "
                   "run `make promote` after a good train-flow/prod run, then commit baseline/")  # fmt: skip
        publish_no_baseline(message)
        logger.warning("%s", message)
        return _drift_attention(base, drift, unread, f"no regression check: {message}") or Failed(message=message)
    with tempfile.TemporaryDirectory(prefix="regression-flow-") as scratch:
        model = (
            _promoted_model(repo, params)
            if revision is None
            else _model_at_revision(repo, params, revision, Path(scratch))
        )
        logger.info("production model: %s", model.detail)
        try:
            promoted = load_promoted_test_set(repo / params.paths.baseline) if revision is None else None
            metrics = score(model, repo / params.paths.shards, params.regression.batch_size, promoted)
        except ModelIntegrityError as exc:
            publish_integrity_failure(exc)
            raise
    verdict = compare(metrics, baseline, params.regression.rules)
    notes = [
        f"model: {model.detail}; sha256 `{model.expected_sha256}` verified before use",
        f"test set: {metrics['num_samples']} images, sha256 `{metrics.get('test_set_sha256')}`"
        + (" (the promoted test images of today's split)" if promoted is not None else ""),
        f"baseline: {params.paths.baseline / BASELINE_METRICS}",
    ]
    publish_nightly(verdict, notes)
    flow_run = (str(runtime.flow_run.id), flow_run_url(runtime.flow_run.id))
    tracking.nightly(params, repo, metrics, verdict.status, verdict.passed, model.expected_sha256, flow_run)
    table = format_table(verdict)
    logger.info("%s", table)
    if not verdict.passed:
        # A plain Failed: the drift automation does not see drift (or DriftUnread) behind a regression.
        found = (f"; and drift of {base}: {summary(drift)}" if drifted  # type: ignore[arg-type]
                 else f"; and {unread}" if unread else "")  # fmt: skip
        raise RegressionFound(f"the production model regressed against {params.paths.baseline}{found}:\n{table}")
    checked = "the regression check passed: the model is as good as its baseline on the test set"
    if drifted:
        checked += ", but traffic no longer looks like the test set"
    return _drift_attention(base, drift, unread, checked) or {"passed": verdict.passed, "metrics": metrics,
                                                              "drift": drift}  # fmt: skip


if __name__ == "__main__":
    regression_flow()
