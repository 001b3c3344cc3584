"""The served model's drift, read by the nightly flow: GET <server>/drift -> a Prefect table + a PNG artifact.

`checked_server(url, allowed)` accepts http[s]://host[:port] on 127.0.0.1 / localhost / ::1 or a URL listed
in params.yaml `regression.drift_servers`, nothing else (no path, no credentials: the flow reads one
fixed route over HTTP, never a shell). `read_drift` answers the server's report or one line saying why
not; `publish_drift` makes the artifacts; `drift_figure` draws expected against observed class mix,
top-1 and margin. The nightly reads the server's verdict; it never judges the statistics itself.
`unread_nights` counts the runs in a row that could not read the server, from the Prefect API.
"""

from __future__ import annotations

import base64
import io
import urllib.parse
from collections.abc import Sequence
from typing import Any

import httpx
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterKey,
    FlowFilter,
    FlowFilterId,
    FlowRunFilter,
    FlowRunFilterDeploymentId,
    FlowRunFilterId,
    FlowRunFilterStartTime,
)
from prefect.client.schemas.sorting import ArtifactSort, FlowRunSort
from prefect.context import FlowRunContext

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
TABLE_KEY, FIGURE_KEY = "regression-flow-drift", "regression-flow-drift-figure"
TIMEOUT_S = 10.0
DRIFT_STATE = "Drift"  # the name of the state a nightly run with drift ends in (the drift automation matches it)
# ... and the one a run ends in when the server could not be read on regression.drift_unreadable_nights runs in a row
DRIFT_UNREAD_STATE = "DriftUnread"
# The NOT READ artifact's description: how a later run knows this one could not read its server (unread_nights).
UNREAD_DESCRIPTION = "regression-flow: the server's /drift was not read"
# Earlier runs read back from the API to find the last ones that asked for the same server; their newest artifacts
# are read two a run (a retry adds one), 100 at most: within the 200 a Prefect server answers by default.
LOOKBACK_RUNS = 50


class DriftUnavailable(RuntimeError):
    """The server could not be read (down, not ready, not a drift report): one line, the run goes on."""


def checked_server(url: str, allowed: Sequence[str] = ()) -> str:
    """`url` as scheme://host[:port], refused (ValueError naming it) unless it is local or configured."""
    try:
        parts = urllib.parse.urlsplit(url.strip())
        host, _ = parts.hostname, parts.port  # .port raises on a port that is not a number
    except ValueError as exc:
        raise ValueError(f"server {url!r}: not a URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not host or parts.username or parts.password:
        raise ValueError(f"server {url!r}: expected http://host[:port] or https://host[:port]")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"server {url!r}: give the server's root (the flow reads its /drift), no path or query")
    base = f"{parts.scheme}://{parts.netloc}"
    if host in LOCAL_HOSTS or base in {a.strip().rstrip("/") for a in allowed}:
        return base
    raise ValueError(f"server {url!r}: not on 127.0.0.1/localhost and not listed in params.yaml "
                     "regression.drift_servers; add it there to let the nightly flow read it")  # fmt: skip


def read_drift(base: str) -> dict[str, Any]:
    """The server's GET /drift report; DriftUnavailable (one line) when it cannot be had."""
    url = f"{base}/drift"
    try:
        response = httpx.get(url, timeout=TIMEOUT_S, follow_redirects=False)
    except httpx.HTTPError as exc:
        raise DriftUnavailable(f"cannot read {url}: {type(exc).__name__}: {exc}") from None
    if response.status_code != 200:
        detail = response.text[:200].replace("\n", " ")
        raise DriftUnavailable(f"{url} answered {response.status_code}: {detail}")
    try:
        report = response.json()
        report["verdict"], report["window"]  # noqa: B018 - the keys every /drift report has
    except (ValueError, KeyError, TypeError):
        raise DriftUnavailable(f"{url} did not answer a drift report (JSON with verdict and window)") from None
    return report


def summary(report: dict[str, Any]) -> str:
    """One line: the verdict, the window, each statistic that exceeded its threshold, the classes that moved."""
    window = report["window"]
    head = f"{report['verdict']} over the last {window['filled']} of {window['size']} predictions"
    exceeded = [f"{name} {s['value']:.3f} > {s['threshold']}{_source(s, ' ({})')}"
                for name, s in report.get("statistics", {}).items() if s["exceeded"]]  # fmt: skip
    moved = ", ".join(f"{m['class']} {m['change']:+.1%}" for m in report.get("moved_most", []))
    return "; ".join(part for part in (head, ", ".join(exceeded), f"moved most: {moved}" if moved else "") if part)


def _source(statistic: dict[str, Any], form: str = "{}") -> str:
    """Where a statistic's threshold comes from (calibrated at export, or fixed in params.yaml), formatted; ""
    from a server that does not say."""
    source = statistic.get("source")
    return form.format(source) if source else ""


def table_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each statistic with its threshold and where it comes from, then each class with expected and observed
    share and contribution."""
    rows: list[dict[str, Any]] = [
        {"what": name, "value": s["value"], "threshold": s["threshold"], "source": _source(s) or None,
         "expected": None, "observed": None, "drift": s["exceeded"]}
        for name, s in report.get("statistics", {}).items()
    ]  # fmt: skip
    rows += [{"what": f"class {row['class']}", "value": row["contribution"], "threshold": None, "source": None,
              "expected": row["expected"], "observed": row["observed"], "drift": None}
             for row in report.get("classes", [])]  # fmt: skip
    return rows


def drift_figure(report: dict[str, Any]) -> bytes:
    """PNG: expected against observed class mix, top-1 probability and margin (shares per bin)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), gridspec_kw={"width_ratios": [1.4, 1, 1]})
    classes = report["classes"]
    x = np.arange(len(classes))
    axes[0].bar(x - 0.2, [c["expected"] for c in classes], 0.4, label="expected (test split)", color="#9aa5c4")
    axes[0].bar(x + 0.2, [c["observed"] for c in classes], 0.4, label="observed (window)", color="#d9534f")
    axes[0].set_xticks(x, [c["class"] for c in classes], rotation=45, ha="right")
    psi = report["statistics"]["class_mix_psi"]
    axes[0].set_title(f"class mix: PSI {psi['value']:.3f} (threshold {psi['threshold']})")
    axes[0].set_ylabel("share of predictions")
    axes[0].legend()
    for ax, part, label in ((axes[1], "top1", "top-1 probability"), (axes[2], "margin", "margin (top-1 - top-2)")):
        hist = report[part]
        edges = [0.0, *hist["edges"], 1.0]
        names = [f"{lo:.4f}-{hi:.4f}" for lo, hi in zip(edges[:-1], edges[1:], strict=True)]  # top deciles: 0.999x
        expected = np.array(hist["expected"], dtype=float)
        observed = np.array(hist["observed"], dtype=float)
        b = np.arange(len(names))
        ax.bar(b - 0.2, expected / max(expected.sum(), 1), 0.4, label="expected", color="#9aa5c4")
        ax.bar(b + 0.2, observed / max(observed.sum(), 1), 0.4, label="observed", color="#d9534f")
        ax.set_xticks(b, names, rotation=60, ha="right", fontsize=7)
        stat = report["statistics"][f"{part}_psi"]
        ax.set_title(f"{label}: PSI {stat['value']:.3f} (threshold {stat['threshold']})")
        ax.set_xlabel("bins of equal test-split mass")
    fig.suptitle(summary(report), fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def figure_markdown(base: str, report: dict[str, Any], png: bytes | None) -> str:
    review = report.get("review", {})
    saved = review.get("saved")
    review_line = (f"[{saved} low-confidence inputs saved for review](file://{review['dir']}) in `{review['dir']}` "
                   f"(at most {review.get('max_files')}): relabel them, `make add-data SRC={review['dir']} "
                   "INTO=<dataset>`, retrain (docs: Watching a deployed model)") if saved is not None \
        else "review folder: not reported"  # fmt: skip
    lines = [
        f"# Drift of {base}: {report['verdict'].upper()}",
        "",
        f"- {summary(report)}",
        f"- {report.get('scope', '')}",
        f"- model: `{(report.get('model') or {}).get('version')}`",
        *[
            f"- {name} threshold {s['threshold']}{_source(s, ': {}')}"
            for name, s in report.get("statistics", {}).items()
        ],
        f"- {review_line}",
        *[f"- replica {r['url']}: {r['verdict']} over {r['filled']} predictions" for r in report.get("replicas", [])],
        *[f"- **replica {u['url']} NOT READ**: {u['why']}" for u in report.get("unreadable", [])],
        "",
    ]
    if png is not None:
        lines += [f"![expected against observed](data:image/png;base64,{base64.b64encode(png).decode()})", ""]
    else:
        lines += [f"No figure: {report.get('detail', 'no statistics in this report')}", ""]
    return "\n".join(lines)


def publish_drift(base: str, report: dict[str, Any]) -> None:
    """The table (statistics and per-class shares) and the Markdown artifact with the figure. A merged report with
    replicas left out (flows/drift_replicas.py) names them, and its figure counts as an unread night."""
    png = drift_figure(report) if "statistics" in report else None
    create_table_artifact(table_rows(report) or [{"what": "verdict", "value": report["verdict"]}], key=TABLE_KEY,
                          description=f"drift of {base}/drift: {summary(report)}")  # fmt: skip
    description = UNREAD_DESCRIPTION if report.get("unreadable") else f"drift of {base}: expected against observed"
    create_markdown_artifact(figure_markdown(base, report, png), key=FIGURE_KEY, description=description)


def publish_unavailable(base: str, why: str) -> None:
    """The NOT READ artifact: under the figure's key, so its history shows the nights without a figure, and with
    UNREAD_DESCRIPTION, which `unread_nights` of later runs looks for."""
    markdown = f"# Drift of {base}: NOT READ\n\n{why}\n\nThe regression check ran without it.\n"
    create_markdown_artifact(markdown, key=FIGURE_KEY, description=UNREAD_DESCRIPTION)


def _same_server(server: object, base: str, allowed: Sequence[str]) -> bool:
    try:
        return isinstance(server, str) and checked_server(server, allowed) == base
    except ValueError:
        return False


def unread_nights(base: str, allowed: Sequence[str], limit: int, server: str | None) -> int:
    """The runs in a row, this one included (it could not read `base`), that could not read the server; at most
    `limit` (regression.drift_unreadable_nights). Called from a regression-flow run.

    The earlier runs are this flow's runs of the same deployment (or, run without one, of no deployment) that
    asked for the same server (`server`, the run's parameter; None: the ones without it, which read
    regression.drift_urls), newest first, read back from the Prefect API. A run could not read it when its
    drift artifact is the NOT READ one, and read it when it is a figure. The artifact belongs to the run whatever
    state the run ended in (Completed, no baseline, a regression, a crash after the read), where its state's
    name or message would not tell. A run that never came to the read (no artifact) counts neither way.
    """
    context = FlowRunContext.get()
    if limit <= 1 or context is None or context.flow_run is None:
        return 1
    run = context.flow_run
    deployment = (FlowRunFilterDeploymentId(any_=[run.deployment_id]) if run.deployment_id
                  else FlowRunFilterDeploymentId(is_null_=True))  # fmt: skip
    earlier_runs = FlowRunFilter(id=FlowRunFilterId(not_any_=[run.id]), deployment_id=deployment,
                                 start_time=FlowRunFilterStartTime(is_null_=False))  # fmt: skip
    with get_client(sync_client=True) as client:
        earlier = client.read_flow_runs(flow_filter=FlowFilter(id=FlowFilterId(any_=[run.flow_id])),
                                        flow_run_filter=earlier_runs, sort=FlowRunSort.START_TIME_DESC,
                                        limit=LOOKBACK_RUNS)  # fmt: skip
        asked = [r.id for r in earlier if (_same_server(r.parameters.get("server"), base, allowed) if server
                                           else r.parameters.get("server") is None)]  # fmt: skip
        if not asked:
            return 1
        of_runs = ArtifactFilter(
            key=ArtifactFilterKey(any_=[FIGURE_KEY]), flow_run_id=ArtifactFilterFlowRunId(any_=asked)
        )
        artifacts = client.read_artifacts(artifact_filter=of_runs, sort=ArtifactSort.CREATED_DESC,
                                          limit=2 * len(asked))  # fmt: skip
    latest: dict[Any, Any] = {}
    for artifact in artifacts:  # newest first: a retried run's last attempt decides
        latest.setdefault(artifact.flow_run_id, artifact)
    nights = 1
    for run_id in asked:
        artifact = latest.get(run_id)
        if artifact is None:
            continue
        if artifact.description != UNREAD_DESCRIPTION:
            break
        nights += 1
        if nights >= limit:
            break
    return nights


def unread_message(base: str, nights: int, why: str) -> str:
    """The DriftUnread state's message."""
    return (f"drift of {base} not read on {nights} run(s) in a row (regression.drift_unreadable_nights): {why}; "
            "start the server or fix the URL, and check `curl <server>/drift`")  # fmt: skip
