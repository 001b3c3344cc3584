"""A measured figure lives on docs/benchmarks.md alone: every other page links to it rather than restating
it, so two pages can never quote two different numbers for one measurement.

A measured figure here is a number with a time unit (s, ms, µs, min, seconds, minutes) or a rate (img/s,
req/s). Excluded, and why:
- fenced code blocks: command lines and examples of a command's output (the README's run summary), which
  show what a run prints, not a claim about how fast anything is;
- a line that ends a setting with `<!-- a setting -->` (invisible in the rendered page): a configured value
  such as a heartbeat interval is not a measurement.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.project import ROOT

pytestmark = pytest.mark.fast

FIGURE = re.compile(r"(?<![\w.])(?<![A-Za-z]-)\d[\d,]*(\.\d+)?\s?(s|ms|µs|us|min|seconds|minutes|img/s|req/s)(?![\w/])")
SETTING = "<!-- a setting -->"


def figures(text: str) -> list[tuple[int, str]]:
    found, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or SETTING in line:
            continue
        found += [(number, match.group(0)) for match in FIGURE.finditer(line)]
    return found


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if p.name != "benchmarks.md")]


def test_the_rule_finds_figures_and_spares_examples_and_settings() -> None:
    text = "It takes 2.4 s here, 16 img/s at 224 px, 60-77 s a run.\n"
    text += "```\nlatency 5.27 ms\n```\nevery 30 s <!-- a setting -->\n"
    assert figures(text) == [(1, "2.4 s"), (1, "16 img/s"), (1, "77 s")]
    assert figures("`timeout_s: 90`, step 3 of 5, ResNet-18s, 10,000 images") == []


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_but_benchmarks_quotes_a_measured_figure(page: Path) -> None:
    found = figures(page.read_text())
    assert not found, (f"{page.relative_to(ROOT)} quotes measured figures {found}: put them on docs/benchmarks.md "
                       "and link there (or mark a configured value `<!-- a setting -->`)")  # fmt: skip
