"""The served model's drift, read by the nightly flow: GET <server>/drift -> a Prefect table + a PNG artifact.

`checked_server(url, allowed)` accepts http[s]://host[:port] on 127.0.0.1 / localhost / ::1 or a URL listed
in params.yaml `regression.drift_servers`, nothing else (no path, no credentials: the flow reads one
fixed route over HTTP, never a shell). `read_drift` answers the server's report or one line saying why
not; `publish_drift` makes the artifacts; `drift_figure` draws expected against observed class mix,
top-1 and margin.
"""

from __future__ import annotations

import base64
import io
import urllib.parse
from collections.abc import Sequence
from typing import Any

import httpx
from prefect.artifacts import create_markdown_artifact, create_table_artifact

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
TABLE_KEY, FIGURE_KEY = "regression-flow-drift", "regression-flow-drift-figure"
TIMEOUT_S = 10.0
DRIFT_STATE = "Drift"  # the name of the state a nightly run with drift ends in (the drift automation matches it)


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
    exceeded = [f"{name} {s['value']:.3f} > {s['threshold']}" for name, s in report.get("statistics", {}).items()
                if s["exceeded"]]  # fmt: skip
    moved = ", ".join(f"{m['class']} {m['change']:+.1%}" for m in report.get("moved_most", []))
    return "; ".join(part for part in (head, ", ".join(exceeded), f"moved most: {moved}" if moved else "") if part)


def table_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each statistic with its threshold, then each class with expected and observed share and contribution."""
    rows: list[dict[str, Any]] = [
        {"what": name, "value": s["value"], "threshold": s["threshold"], "expected": None, "observed": None,
         "drift": s["exceeded"]} for name, s in report.get("statistics", {}).items()
    ]  # fmt: skip
    rows += [{"what": f"class {row['class']}", "value": row["contribution"], "threshold": None,
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
                   f"(at most {review.get('max_files')}): relabel them, `make add-data`, retrain (docs: Watching a "
                   "deployed model)") if saved is not None else "review folder: not reported"  # fmt: skip
    lines = [
        f"# Drift of {base}: {report['verdict'].upper()}",
        "",
        f"- {summary(report)}",
        f"- {report.get('scope', '')}",
        f"- model: `{(report.get('model') or {}).get('version')}`",
        f"- {review_line}",
        "",
    ]
    if png is not None:
        lines += [f"![expected against observed](data:image/png;base64,{base64.b64encode(png).decode()})", ""]
    else:
        lines += [f"No figure: {report.get('detail', 'no statistics in this report')}", ""]
    return "\n".join(lines)


def publish_drift(base: str, report: dict[str, Any]) -> None:
    """The table (statistics and per-class shares) and the Markdown artifact with the figure."""
    png = drift_figure(report) if "statistics" in report else None
    create_table_artifact(table_rows(report) or [{"what": "verdict", "value": report["verdict"]}], key=TABLE_KEY,
                          description=f"drift of {base}/drift: {summary(report)}")  # fmt: skip
    create_markdown_artifact(figure_markdown(base, report, png), key=FIGURE_KEY,
                             description=f"drift of {base}: expected against observed")  # fmt: skip


def publish_unavailable(base: str, why: str) -> None:
    markdown = f"# Drift of {base}: NOT READ\n\n{why}\n\nThe regression check ran without it.\n"
    create_markdown_artifact(markdown, key=FIGURE_KEY, description="regression-flow: the server's /drift was not read")
