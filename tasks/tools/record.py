"""Is the run record in this workspace this workspace's run? What make commit-run and make promote check first.

A record is refused, in one line that names the stage or file, the two hashes and the command that fixes it,
when a stage is not up to date by DVC's own status (a partial run: `dvc repro export` after a params change),
when the verdict (reports/regression.json) scored another ONNX file or compared against another baseline than
the one here now, and when an export gate failed, whatever the verdict (`different test set` included).

A failed gate is no partial run: check_regression wrote its verdict and exited 1, so DVC recorded no
check_regression. When that stage alone is stale and the verdict scored this ONNX file against this baseline
on these shards' test set, judged by the rules and gate code here now (its `judged_by`), the refusal names the
gate's verdict and `make promote ACCEPT="<why>"`, and promote with a reason passes (`accepting`): a
documented command leads out of every failed gate. Otherwise the gate must run again (`make run`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tasks.core.io import read_json, sha256_file
from tasks.core.params import PARAMS_FILE, ParamsError, load_params
from tasks.core.paths import Paths
from tasks.core.private_api import dvc_stale_stages
from tasks.core.provenance import md5_file
from tasks.images.image_set import split_sha256
from tasks.images.shards import ShardError, load_manifest
from tasks.release.gate import ACCEPT_COMMAND, failed_export_gates
from tasks.release.production import baseline_sha256

GATE_STAGE = "check_regression"


def _short(sha: str | None) -> str:
    return sha[:12] if sha else "none"


def record_refusal(paths: Paths, root: Path = Path(), *, accepting: bool = False) -> str | None:
    """Why the run record in this workspace is not this workspace's run, or None. One line that names the
    stage or file and the two hashes, and the command that fixes it. `accepting` (make promote ACCEPT=)
    lets a failed gate of this very run through: the verdict itself then proves what it scored."""
    stale = dvc_stale_stages(root)
    verdict_path = paths.regression_json
    try:
        verdict: dict[str, Any] | None = read_json(root / verdict_path)
    except FileNotFoundError:
        verdict = None
    failed_gate = (set(stale) == {GATE_STAGE} and verdict is not None and verdict.get("passed") is False
                   and _stale_verdict(verdict, paths, root) is None)  # fmt: skip
    otherwise = _judged_otherwise(verdict, root) if failed_gate and verdict is not None else None
    if otherwise:
        return (f"{verdict_path}: the gate failed, but {otherwise}; run `dvc repro` (make run) so the gate judges "
                "this model by the rules and code here")  # fmt: skip
    if failed_gate and verdict is not None:
        if not accepting:
            return (f"the gate failed on this run ({verdict.get('summary', '')}), so DVC recorded no {GATE_STAGE}: "
                    f"fix the model, or make it the baseline anyway, saying why: `{ACCEPT_COMMAND}`")  # fmt: skip
        stale = {}
    if stale:
        stage, reasons = next(iter(stale.items()))
        more = f" (and {', '.join(list(stale)[1:])})" if len(stale) > 1 else ""
        return (f"stage {stage} is not up to date by `dvc status`{more}: {reasons[0]}; the record would describe "
                "a run that did not happen. Run `dvc repro` (make run) first")  # fmt: skip
    if verdict is None:
        return f"{verdict_path}: not there; run `dvc repro` (make run) so the model is scored"
    refusal = _stale_verdict(verdict, paths, root, shards=False)
    if refusal:
        return refusal
    failed = failed_export_gates(verdict)
    if failed:
        return (f"{verdict_path}: export gate failed: {'; '.join(failed)} (verdict '{verdict.get('verdict')}'); "
                "fix the export (params.yaml export.int8) and run `dvc repro`")  # fmt: skip
    return None


def _judged_otherwise(verdict: Mapping[str, Any], root: Path) -> str | None:
    """Why the verdict's rules or gate code are not the ones here now (changed since it was written), or None:
    a failed verdict judged by other rules or code needs the gate to run again (`make run`), not a reason."""
    judged = verdict.get("judged_by") or {}
    try:
        rules = load_params(root / PARAMS_FILE).regression.model_dump(mode="json")
    except (ParamsError, OSError):
        return "params.yaml cannot be read"
    if judged.get("regression") != rules:
        return "params.yaml's regression section changed since the verdict"
    code = judged.get("code") or {}
    changed = sorted(f for f, md5 in code.items() if not (root / f).is_file() or md5_file(root / f) != md5)
    if not code or changed:
        return f"the gate's code changed since the verdict ({', '.join(changed[:3]) or 'not recorded'})"
    return None


def _stale_verdict(verdict: Mapping[str, Any], paths: Paths, root: Path, *, shards: bool = True) -> str | None:
    """Why the verdict is not about this ONNX file, this baseline (and these shards' test set), or None."""
    verdict_path = paths.regression_json
    scored = (verdict.get("model") or {}).get("onnx_sha256")
    onnx = sha256_file(root / paths.onnx) if (root / paths.onnx).is_file() else None
    if scored != onnx:
        return (f"{verdict_path} scored ONNX sha256 {_short(scored)}, but {paths.onnx} is {_short(onnx)}; "
                "run `dvc repro` (make run) so the gate scores this model")  # fmt: skip
    if "baseline_sha256" not in verdict:
        return f"{verdict_path} does not record which baseline it compared against; run `dvc repro` (make run)"
    compared, here = verdict["baseline_sha256"], baseline_sha256(root / paths.baseline)
    if compared != here:
        return (f"{verdict_path} compared against baseline sha256 {_short(compared)}, but {paths.baseline}/ is now "
                f"{_short(here)}; run `dvc repro` (make run) so the gate compares this model with it")  # fmt: skip
    if shards:
        try:
            test_set = split_sha256(load_manifest(root / paths.shards))
        except (ShardError, OSError, KeyError) as exc:
            return f"{paths.shards}: cannot read its test set ({exc}); run `dvc repro` (make run)"
        scored_set = (verdict.get("metrics") or {}).get("test_set_sha256")
        if scored_set != test_set:
            return (f"{verdict_path} scored test set sha256 {_short(scored_set)}, but {paths.shards} now holds "
                    f"{_short(test_set)}; run `dvc repro` (make run) so the gate scores this test set")  # fmt: skip
    return None
