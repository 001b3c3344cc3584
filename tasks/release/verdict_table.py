"""The gate's verdict as a table: an aligned text table for the log, a Markdown one for regression.md and the
flows' artifacts, one row per checked key (with a paired test, also its images, p-value, adjusted p and test)."""

from __future__ import annotations

from tasks.release.verdict import RuleResult, Verdict, cell


def _p_cell(p: float | None) -> str:
    return "-" if p is None else f"{p:.4f}" if p >= 1e-4 else f"{p:.1e}"


def _p_cells(r: RuleResult) -> str:
    """`0.0057 (adjusted 0.52)`: the rule's p, and its weighted-Holm adjusted p when the family made it larger."""
    if r.p_adjusted is None or r.p_value is None or r.p_adjusted == r.p_value:
        return _p_cell(r.p_value)
    return f"{_p_cell(r.p_value)} (adjusted {_p_cell(r.p_adjusted)})"


def _outcome(r: RuleResult) -> str:
    if not r.passed:
        return f"FAIL: {r.reason}"
    if not r.judged:
        return r.reason
    return "PASS" if r.reason == "ok" else f"PASS: {r.reason}"


def format_table(verdict: Verdict, *, markdown: bool = False) -> str:
    """The verdict as an aligned text table (or a Markdown table), one row per checked key; with a paired test,
    each row also gives its images (n), p-value (with its adjusted one) and test."""
    outcome = "verdict: " + ("PASS" if verdict.passed else verdict.status.upper())
    if verdict.mismatch:
        sections = [verdict.mismatch]
    elif verdict.has_baseline:
        paired = verdict.alpha is not None
        header = ("metric", "value", "baseline", "delta", "allowed") + (("n", "p", "test") if paired else ())
        rows = [(*header, "result")]
        for r in verdict.results:
            cells = (f"{r.metric} ({r.direction})", cell(r.value), cell(r.baseline),
                     "-" if r.delta is None else f"{r.delta:+.4f}", cell(r.allowed))  # fmt: skip
            n = "-" if r.n is None else str(r.n)
            extra = (n, _p_cells(r), r.test or "-") if paired else ()
            rows.append((*cells, *extra, _outcome(r)))
        sections = [verdict.baseline_note] if verdict.baseline_note else []
        sections.append(_table(rows, markdown))
        if paired:
            m, few = verdict.family, len(verdict.too_few)
            sections.append(
                f"a rule fails when it is worse than allowed and its paired test on the same images, weighted-Holm "
                f"adjusted over the {m} rules that could fail on these predictions (Tarone), gives p < alpha "
                f"({verdict.alpha:g}, family-wise); {few} of {len(verdict.results)} rules not judged: even the "
                f"smallest loss beyond the tolerance, every lost image a disagreement, could not reach the highest "
                f"level the family could give it (regression.unjudged: {verdict.unjudged})"
            )
    else:
        sections = ["no baseline yet: nothing to compare against (promote one with `make promote`)"]
    if verdict.gates:
        rows = [("export gate", "value", "limit", "params.yaml", "result")]
        for g in verdict.gates:
            rows.append((g.name, f"{g.value:.4f}", f"{g.op} {g.limit:g}", f"export.{g.param}",
                         "PASS" if g.passed else "FAIL"))  # fmt: skip
        sections.append(_table(rows, markdown))
    if markdown:
        return "\n\n".join([*sections, f"**{outcome}**"])
    return "\n\n".join(sections) + "\n" + outcome


def _table(rows: list[tuple[str, ...]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(row) + " |" for row in rows]
        lines.insert(1, "|" + "---|" * len(rows[0]))
        return "\n".join(lines)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
