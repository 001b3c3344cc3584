"""The README's copy of the committed run's end-of-run summary is what `make run` prints for the committed record.

The block is rendered here by the summary's own `render` from the committed reports (metrics.json, export.json,
regression.json, train_run.json, environment/train.json), and the sentence that introduces it must name the CPU
kind the record was made on. A new run record without a new README block, or a block copied from another
machine's run, fails here. Two inputs are not part of the committed record, and are taken as follows:
- the quarantine counts (data/shards/quarantine.json is a DVC output): accepted is the number of images the
  evaluate stage scored for label errors (every accepted image); for the default data every drawn image is
  accepted, so nothing was quarantined or ignored;
- export_timings.json is per machine and git-ignored: the summary then says latency is not in the record.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from tasks.core.io import read_json
from tasks.core.params import load_params
from tasks.tools.summary import render
from tests.helpers.project import ROOT

pytestmark = pytest.mark.fast

BLOCK = re.compile(r"^```[^\n]*\n(Pipeline finished\n.*?)\n```", re.M | re.S)


def describe_machine(environment: Mapping[str, Any]) -> str:
    """`x86_64, avx512_bf16 without AMX: bf16, channels_last, 2 threads`: the CPU kind and what train resolved."""
    flags = set(environment.get("cpu", {}).get("flags", []))
    bf16 = "avx512_bf16" if "avx512_bf16" in flags else "no avx512_bf16"
    amx = "with AMX" if "amx_tile" in flags else "without AMX"
    return (f"{environment.get('arch', '-')}, {bf16} {amx}: {environment.get('precision', '-')}, "
            f"{environment.get('memory_format', '-')}, {environment.get('threads', '-')} threads")  # fmt: skip


def committed_summary(root: Path) -> tuple[str, str]:
    """(the summary text, the machine description) of the run record committed under `root`."""
    params = load_params(root / "params.yaml")
    reports = root / "reports"
    generate = params.generate
    drawn = generate.num_classes * generate.images_per_class
    accepted = read_json(reports / "label_errors.json")["images_scored"]
    assert accepted == drawn, f"the default data: {drawn} drawn, {accepted} accepted; the record is not the default"
    environment = read_json(reports / "environment" / "train.json")
    text = render(
        params,
        metrics=read_json(reports / "metrics.json"),
        export=read_json(reports / "export.json"),
        verdict=read_json(reports / "regression.json"),
        quarantine={"accepted": accepted, "quarantined": 0, "ignored": 0},
        train_run=read_json(reports / "train_run.json"),
        environment=environment,
        timings={},
    )
    return text, describe_machine(environment)


def summary_blocks(text: str) -> list[tuple[str, str]]:
    """Each fenced block that is a run summary, with the paragraph just before it."""
    found = []
    for match in BLOCK.finditer(text):
        before = text[: match.start()].rstrip().rsplit("\n\n", 1)[-1]
        found.append((before, match.group(1)))
    return found


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_the_readme_shows_a_summary() -> None:
    assert summary_blocks((ROOT / "README.md").read_text()), "README.md: no fenced block starting `Pipeline finished`"


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_summary_on_a_page_is_the_committed_records(page: Path) -> None:
    expected, machine = committed_summary(ROOT)
    for intro, block in summary_blocks(page.read_text()):
        assert block == expected, (
            f"{page.relative_to(ROOT)}: the run summary is not the committed record's; replace the block with:\n"
            f"{expected}"
        )
        assert machine in intro, f"{page.relative_to(ROOT)}: the sentence before the summary must name {machine!r}"
