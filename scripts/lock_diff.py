"""Does this checkout's run reproduce a committed one? dvc.lock and the environment records here vs at REV.

    .venv/bin/python scripts/lock_diff.py [REV]      # REV defaults to HEAD; `make check-reproduced` runs it

Three outcomes, each named:
- identical: every stage's command, deps, params and outputs are the same (exit 0);
- the same environment but different bytes: a stage whose inputs, upstream outputs and environment
  record are all the committed ones wrote other outputs. That is a reproducibility bug, named by stage
  and file (exit 1);
- another environment: the stages' environment records (reports/environment/<stage>.json: precision,
  threads, CPU features, library versions) differ, and every differing output follows from that. Each
  difference is named ("train: precision bf16 here, fp32 in the committed run") with the test metrics'
  deltas against the committed run; it passes when every delta is within TOLERANCE (exit 0), else exit 1.
A changed command, code file, data folder or param is not a reproduction at all: listed, exit 1.

Before any of this, the workspace must hold the run its dvc.lock records: every stage up to date by
DVC's own status (`dvc status`; the environment stage's "always changed" aside). With nothing run (a
fresh clone), or after a stage that failed or was interrupted, it names what is missing or stale and
exits 1: two dvc.lock files alone say nothing about outputs that are not there.

And only what this workspace computed is judged. The run ledger (tasks/core/provenance.py) says which
stages' outputs on disk a run here wrote; outputs that `dvc pull`, DVC's run cache or a checkout put here
are named "not recomputed here" and the answer is exit 1: with none recomputed, one line that says so and
points at `make reproduce`, which recomputes a committed run in a scratch copy (scripts/reproduce.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the project's packages

from tasks.core import provenance  # noqa: E402
from tasks.core.dag import load_stages  # noqa: E402
from tasks.core.nested import flatten  # noqa: E402
from tasks.core.private_api import dvc_stale_stages  # noqa: E402

ENVIRONMENT = "environment"  # the stage that writes each stage's environment record
METRICS = "reports/metrics.json"
# Every metric file the run writes, and how far another environment (bf16 instead of fp32, another torch)
# may move each figure, in absolute terms. On the default data bf16 and fp32 CPUs gave test accuracy 0.9481
# and 0.9502: 0.0021 apart. ONNX and TorchScript agree with PyTorch on (nearly) every test image in any
# environment; INT8's agreement and accuracy drop move with the calibration's rounding.
TOLERANCE = {"accuracy": 0.01, "macro_f1": 0.01}
JUDGED: dict[str, dict[str, float]] = {
    METRICS: TOLERANCE,
    "reports/export.json": {
        "agreement": 0.005,
        "torchscript.agreement": 0.005,
        "onnx_int8.agreement": 0.02,
        "onnx_int8.accuracy_drop": 0.01,
    },  # fmt: skip
}
# The regression verdict: another environment may move the figures, never the verdict.
VERDICT = "reports/gate.json"


def _by_path(entries: list[dict[str, Any]] | None) -> dict[str, str]:
    return {e["path"]: provenance.lock_digest(e) for e in entries or []}


def _changed(a: dict[str, str], b: dict[str, str]) -> list[str]:
    return [p for p in sorted(set(a) | set(b)) if a.get(p) != b.get(p)]


def produced(lock: dict[str, Any]) -> dict[str, str]:
    """Every output path -> the stage that writes it."""
    return {e["path"]: name for name, stage in lock.items() for e in stage.get("outs") or []}


def classify(old: dict[str, Any], new: dict[str, Any]) -> dict[str, dict[str, list[str]]]:
    """Per stage that differs: its changed `inputs` (cmd, params, code and data deps), `upstream` outputs,
    `environment` record, and `outs`."""
    made_by = {**produced(old), **produced(new)}
    found: dict[str, dict[str, list[str]]] = {}
    for stage in sorted(set(old) | set(new)):
        if stage not in new or stage not in old:
            found[stage] = {"inputs": [f"{'removed' if stage not in new else 'new'} stage"], "upstream": [],
                            "environment": [], "outs": []}  # fmt: skip
            continue
        a, b = old[stage], new[stage]
        inputs = ["cmd"] if a.get("cmd") != b.get("cmd") else []
        params_a, params_b = a.get("params", {}).get("params.yaml", {}), b.get("params", {}).get("params.yaml", {})
        inputs += [f"params {k}" for k in sorted(set(params_a) | set(params_b)) if params_a.get(k) != params_b.get(k)]
        upstream, environment = [], []
        for path in _changed(_by_path(a.get("deps")), _by_path(b.get("deps"))):
            writer = made_by.get(path)
            if writer == ENVIRONMENT:
                environment.append(path)
            elif writer:
                upstream.append(path)
            else:
                inputs.append(f"dep {path}")
        outs = _changed(_by_path(a.get("outs")), _by_path(b.get("outs")))
        if stage == ENVIRONMENT:  # its outputs are the records compared per stage below
            outs = []
        if inputs or upstream or environment or outs:
            found[stage] = {"inputs": inputs, "upstream": upstream, "environment": environment, "outs": outs}
    return found


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """One line per difference, as `stage: what`."""
    lines = []
    for stage, diff in classify(old, new).items():
        lines += [f"{stage}: {what}" if what.endswith(" stage") else f"{stage}: {what} changed"
                  for what in diff["inputs"]]  # fmt: skip
        lines += [f"{stage}: dep {path} changed (an upstream output)" for path in diff["upstream"]]
        lines += [f"{stage}: environment record {path} changed" for path in diff["environment"]]
        explained = diff["inputs"] or diff["upstream"] or diff["environment"]
        why = "" if explained else " with the same inputs and environment: not reproduced"
        outs_a, outs_b = _by_path(old.get(stage, {}).get("outs")), _by_path(new.get(stage, {}).get("outs"))
        lines += [f"{stage}: {p} md5 {outs_a.get(p)} -> {outs_b.get(p)}{why}" for p in diff["outs"]]
    return lines


def environment_changes(stage: str, old: dict[str, Any] | None, new: dict[str, Any] | None) -> list[str]:
    """`train: precision bf16 here, fp32 in the committed run`, one line per differing field."""
    if old is None or new is None:
        return [f"{stage}: {'the committed run' if old is None else 'this checkout'} has no environment record"]
    a, b = flatten(old), flatten(new)
    return [f"{stage}: {key} {_shown(b.get(key, '(none)'))} here, {_shown(a.get(key, '(none)'))} in the committed run"
            for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)]  # fmt: skip


def _shown(value: Any) -> str:
    return ", ".join(map(str, value)) if isinstance(value, list) else str(value)


def metric_deltas(old: dict[str, Any], new: dict[str, Any], tolerance: dict[str, float] = TOLERANCE,
                  path: str = METRICS) -> tuple[list[str], bool]:  # fmt: skip
    a, b = flatten(old), flatten(new)
    lines, within = [], True
    for key, allowed in tolerance.items():
        if not _number(a.get(key)) or not _number(b.get(key)):
            if key not in a and key not in b:
                continue  # a figure neither run measured (INT8 off): nothing to judge
            lines.append(f"{key}: missing from {'the committed' if key not in a else 'this'} run's {path}")
            within = False
            continue
        delta = b[key] - a[key]
        ok = abs(delta) <= allowed
        within &= ok
        lines.append(f"{key}: {b[key]:.4f} here, {a[key]:.4f} committed (delta {delta:+.4f}, "
                     f"tolerance {allowed}): {'within' if ok else 'OUTSIDE'}")  # fmt: skip
    return lines, within


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def judge_metrics(rev: str) -> tuple[list[str], bool]:
    """Every metric file the run writes, here against `rev`: its figures within JUDGED's tolerances, and the
    regression verdict the same."""
    lines, within = [], True
    for path, tolerance in JUDGED.items():
        old, new = _json(_show(rev, path)), _json(_read(path))
        if old is None or new is None:
            lines.append(f"{path}: missing {'at ' + rev if old is None else 'here'}: no deltas to judge")
            within = False
            continue
        deltas, ok = metric_deltas(old, new, tolerance, path)
        lines += [f"{Path(path).name} {line}" if path != METRICS else line for line in deltas]
        within &= ok
    old, new = _json(_show(rev, VERDICT)), _json(_read(VERDICT))
    old_verdict, new_verdict = (old or {}).get("verdict"), (new or {}).get("verdict")
    same = old_verdict == new_verdict and old_verdict is not None
    lines.append(f"{Path(VERDICT).name} verdict: {new_verdict!r} here, {old_verdict!r} committed: "
                 f"{'the same' if same else 'OTHER'}")  # fmt: skip
    return lines, within and same


def _show(rev: str, path: str) -> str | None:
    shown = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True)
    return shown.stdout if shown.returncode == 0 else None


def _json(text: str | None) -> Any:
    return json.loads(text) if text else None


def verdict(rev: str, old: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], int]:
    """The lines to print and the exit status."""
    found = classify(old, new)
    if not found:
        return [f"identical: dvc.lock reproduces {rev}: every stage's command, deps, params and outputs"], 0
    inputs = {stage: d["inputs"] for stage, d in found.items() if d["inputs"]}
    if inputs:
        lines = [f"not a reproduction: inputs differ from {rev} (a changed command, code, data or param)"]
        return lines + differences(old, new), 1
    bugs = [f"{stage}: {path}" for stage, d in found.items() if not (d["upstream"] or d["environment"])
            for path in d["outs"]]  # fmt: skip
    if bugs:
        return [
            f"NOT REPRODUCED with the same inputs and the same environment as {rev}: a reproducibility bug in",
            *(f"  {line}" for line in bugs),
        ], 1
    lines = [f"another environment than {rev}; every differing output follows from it:"]
    env_paths = sorted({path for d in found.values() for path in d["environment"]})
    for path in env_paths:
        stage = Path(path).stem
        lines += [f"  {line}" for line in environment_changes(stage, _json(_show(rev, path)), _json(_read(path)))]
    changed_outs = [f"{stage}: {p}" for stage, d in found.items() for p in d["outs"]]
    lines.append(f"  outputs that differ: {', '.join(changed_outs) if changed_outs else 'none'}")
    if not changed_outs:
        return [*lines, "identical outputs in another environment"], 0
    deltas, within = judge_metrics(rev)
    lines += [f"  {line}" for line in deltas]
    lines.append("reproduced within tolerance in another environment" if within else
                 "NOT REPRODUCED: another environment moved the metrics beyond the tolerance")  # fmt: skip
    return lines, 0 if within else 1


def _read(path: str) -> str | None:
    return Path(path).read_text() if Path(path).is_file() else None


def workspace_refusal(root: Path = Path(".")) -> list[str]:
    """Why this workspace does not hold the run its dvc.lock records (stage by stage), or []."""
    stale = dvc_stale_stages(root)
    if not stale:
        return []
    lines = ["not comparable: this workspace does not hold the run its dvc.lock records "
             "(nothing run here, or a stage that failed or was interrupted):"]  # fmt: skip
    lines += [f"  {stage}: {why}" for stage, reasons in stale.items() for why in reasons]
    lines.append("run `dvc repro` (make run) to finish the run, or `dvc pull` to fetch a pushed one; then "
                 "make check-reproduced")  # fmt: skip
    return lines


def compare(rev: str) -> tuple[list[str], int]:
    """This workspace's run against `rev`'s record: the lines to print and the exit status."""
    shown = _show(rev, "dvc.lock")
    if shown is None:
        return [f"error: no dvc.lock at {rev}"], 2
    if not Path("dvc.lock").is_file():
        return ["error: no dvc.lock here: run the pipeline first (make run)"], 2
    old = yaml.safe_load(shown)["stages"]
    new = yaml.safe_load(Path("dvc.lock").read_text())["stages"]
    return verdict(rev, old, new)


def judged_here(rev: str, lines: list[str], status: int, root: Path = Path(".")) -> tuple[list[str], int]:
    """`compare`'s answer, kept only for what this workspace computed."""
    if status == 2:  # nothing was compared (no dvc.lock here or at rev)
        return lines, status
    missing, always = provenance.not_recomputed(root)
    if not missing:
        return lines, status
    substantive = [name for name in load_stages(root) if name not in always]
    if len(missing) == len(substantive):
        return [f"nothing reproduced: {len(missing)} stages' outputs came from the remote or the cache "
                f"({', '.join(missing)}), none was computed here; run `make reproduce` (REV={rev}) to recompute "
                "them"], 1  # fmt: skip
    head = [f"not recomputed here: {name} (its outputs came from `dvc pull`, the run cache or a checkout)"
            for name in missing]  # fmt: skip
    return [*head, *lines, f"partly reproduced: {len(missing)} of {len(substantive)} stages were not computed "
            f"here; run `make reproduce` (REV={rev}) to recompute every stage"], 1  # fmt: skip


def main() -> int:
    rev = sys.argv[1] if len(sys.argv) > 1 else "HEAD"
    refusal = workspace_refusal()
    if refusal:
        print("\n".join(refusal))
        return 1
    lines, status = compare(rev)
    try:
        lines, status = judged_here(rev, lines, status)
    except provenance.ProvenanceError as exc:
        lines, status = [f"error: {exc}"], 2
    print("\n".join(lines), file=sys.stderr if status == 2 else sys.stdout)
    return status


if __name__ == "__main__":
    sys.exit(main())
