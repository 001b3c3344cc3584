"""Replicas as one: the nightly reads every server of `regression.drift_urls` and judges their windows together.

Each replica's GET /drift gives its window's counts (per class, per top-1 and margin bin) and each statistic's
threshold curve a + b / n. `merge` sums the counts of the replicas that serve the same model and computes each
PSI on the merged counts (not an average of verdicts), held to the curve at the merged window's size: traffic
that drifts on one replica only still moves the whole. A replica that does not answer, serves another model, or
gives no counts (a server from before replicas) is named in the result and left out; the night counts as unread
toward regression.drift_unreadable_nights (flows/drift.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from flows.drift import DriftUnavailable, read_drift
from tasks.release.drift import NO_REFERENCE, psi_terms
from tasks.release.drift_thresholds import DriftThresholds

PARTS = {"class_mix_psi": "classes", "top1_psi": "top1", "margin_psi": "margin"}


def read_replicas(bases: Sequence[str]) -> tuple[list[tuple[str, dict[str, Any]]], list[dict[str, str]]]:
    """(url, report) of each replica that answered, and {url, why} of each that did not."""
    read, unreadable = [], []
    for base in bases:
        try:
            read.append((base, read_drift(base)))
        except DriftUnavailable as exc:
            unreadable.append({"url": base, "why": str(exc)})
    return read, unreadable


def _counts(report: dict[str, Any], part: str) -> tuple[list[int], list[int]]:
    """(observed, expected) counts of one histogram of a /drift report."""
    if part == "classes":
        return [c["count"] for c in report["classes"]], [c["expected_count"] for c in report["classes"]]
    return list(report[part]["observed"]), list(report[part]["expected"])


def mergeable(report: dict[str, Any]) -> str | None:
    """Why a replica's report cannot be merged, or None."""
    if report["verdict"] == NO_REFERENCE:
        return "its model carries no drift reference"
    if not all("count" in c for c in report.get("classes", [])) or not all(
        "curve" in s for s in report.get("statistics", {}).values()
    ):
        return "its /drift gives no window counts (a server from before replicas): update it"
    return None


def merge(read: list[tuple[str, dict[str, Any]]], unreadable: list[dict[str, str]]) -> dict[str, Any]:
    """One /drift-shaped report over the replicas that serve the model most of them serve; the others are
    added to `unreadable` with why. Raises DriftUnavailable when none can be merged."""
    unreadable = list(unreadable)
    usable = []
    for base, report in read:
        why = mergeable(report)
        if why is None:
            usable.append((base, report))
        else:
            unreadable.append({"url": base, "why": why})
    if not usable:
        raise DriftUnavailable("no replica answered a drift report: " + "; ".join(f"{u['url']}: {u['why']}"
                                                                                   for u in unreadable))  # fmt: skip
    model = Counter((r.get("model") or {}).get("sha256") for _, r in usable).most_common(1)[0][0]
    for base, report in usable:
        if (report.get("model") or {}).get("sha256") != model:
            unreadable.append({"url": base, "why": f"serves model {(report.get('model') or {}).get('sha256')}, not "
                               f"{model} as the others: not merged"})  # fmt: skip
    usable = [(b, r) for b, r in usable if (r.get("model") or {}).get("sha256") == model]
    first = usable[0][1]
    n = sum(r["window"]["filled"] for _, r in usable)
    minimum = first["window"]["min_predictions"]
    merged: dict[str, tuple[list[int], list[int]]] = {}
    for statistic, part in PARTS.items():
        observed = [sum(column) for column in zip(*(_counts(r, part)[0] for _, r in usable), strict=True)]
        merged[statistic] = (observed, _counts(first, part)[1])
    values = {statistic: sum(psi_terms(observed, expected)) for statistic, (observed, expected) in merged.items()}
    verdict, statistics = DriftThresholds.of_report(first).judge(values, n)  # as the server judges one window
    observed, expected = merged["class_mix_psi"]
    total = sum(expected)
    terms = psi_terms(observed, expected)
    classes = [{"class": c["class"], "observed": round(o / n, 4) if n else 0.0, "expected": round(e / total, 4),
                "contribution": round(t, 4), "count": o, "expected_count": e}
               for c, o, e, t in zip(first["classes"], observed, expected, terms, strict=True)]  # fmt: skip
    moved = sorted(classes, key=lambda row: -abs(row["observed"] - row["expected"]))[:3]
    return {
        "verdict": verdict,
        "scope": f"{len(usable)} replicas judged as one: PSI on their merged window counts "
        f"({', '.join(b for b, _ in usable)})",
        "model": first.get("model"),
        "window": {"size": sum(r["window"]["size"] for _, r in usable), "filled": n, "min_predictions": minimum},
        "reference": first.get("reference"),
        "statistics": statistics,
        "classes": classes,
        "moved_most": [{"class": r["class"], "change": round(r["observed"] - r["expected"], 4)} for r in moved],
        "top1": {**first["top1"], "observed": merged["top1_psi"][0]},
        "margin": {**first["margin"], "observed": merged["margin_psi"][0]},
        "replicas": [{"url": b, "verdict": r["verdict"], "filled": r["window"]["filled"]} for b, r in usable],
        "unreadable": unreadable,
    }
