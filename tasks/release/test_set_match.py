"""Whether a baseline known only by its recorded metrics was scored on this run's test images and classes, and
the one line that says so when not (tasks/release/verdict.py). Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _test_set(metrics: Mapping[str, Any]) -> tuple[str, int, tuple[str, ...]]:
    """(test set hash, images, class names) of a metrics dict, as score_split and make promote write them."""
    per_class = metrics.get("per_class")
    classes = tuple(sorted(per_class)) if isinstance(per_class, Mapping) else ()
    return str(metrics.get("test_set_sha256")), int(metrics.get("num_samples") or 0), classes


def describe_test_set(metrics: Mapping[str, Any]) -> str:
    """`963 images, 10 classes (circle, crescent, ...), test set sha256 eb48cd1ff731` for a metrics dict."""
    digest, images, classes = _test_set(metrics)
    names = ", ".join(classes[:5]) + (f", ... ({len(classes) - 5} more)" if len(classes) > 5 else "")
    return f"{images} images, {len(classes)} classes ({names}), test set sha256 {digest[:12]}"


def mismatch(metrics: Mapping[str, Any], baseline: Mapping[str, Any]) -> str:
    """For a baseline known only by its recorded metrics: empty when run and baseline were scored on the same test
    images and classes; else one line naming both and what to do. Rules compare models on one test set; across
    test sets they only produce a wall of `missing`/`differs` lines that say nothing about either model."""
    if "test_set_sha256" not in metrics or "test_set_sha256" not in baseline:
        return ""  # nothing says which test set: compared rule by rule
    ours, theirs = _test_set(metrics), _test_set(baseline)
    if ours[0] == theirs[0] and ours[2] == theirs[2]:
        return ""
    return (
        f"different test set: the baseline was scored on {describe_test_set(baseline)}; this run on "
        f"{describe_test_set(metrics)}. The rules compare models on the same test images: to gate models of this "
        'data, promote one of them, saying why (`make promote ACCEPT="<why>"`); to compare with the baseline, '
        "train on its data"
    )
