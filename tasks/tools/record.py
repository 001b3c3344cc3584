"""Is the run record in this workspace this workspace's run? What make commit-run and make promote check first.

A record is refused, in one line that names the stage or file, the two hashes and the command that fixes it,
when a stage is not up to date by DVC's own status (a partial run: `dvc repro export` after a params change),
when the verdict (reports/regression.json) scored another ONNX file or compared against another baseline than
the one here now, and when an export gate failed, whatever the verdict (`different test set` included).
"""

from __future__ import annotations

from pathlib import Path

from tasks.core.io import read_json, sha256_file
from tasks.core.paths import Paths
from tasks.core.private_api import dvc_stale_stages
from tasks.release.gate import failed_export_gates
from tasks.release.production import baseline_sha256


def _short(sha: str | None) -> str:
    return sha[:12] if sha else "none"


def record_refusal(paths: Paths, root: Path = Path()) -> str | None:
    """Why the run record in this workspace is not this workspace's run, or None. One line that names the
    stage or file and the two hashes, and the command that fixes it."""
    stale = dvc_stale_stages(root)
    if stale:
        stage, reasons = next(iter(stale.items()))
        more = f" (and {', '.join(list(stale)[1:])})" if len(stale) > 1 else ""
        return (f"stage {stage} is not up to date by `dvc status`{more}: {reasons[0]}; the record would describe "
                "a run that did not happen. Run `dvc repro` (make run) first")  # fmt: skip
    verdict_path = paths.regression_json
    try:
        verdict = read_json(verdict_path)
    except FileNotFoundError:
        return f"{verdict_path}: not there; run `dvc repro` (make run) so the model is scored"
    scored = (verdict.get("model") or {}).get("onnx_sha256")
    onnx = sha256_file(paths.onnx) if paths.onnx.is_file() else None
    if scored != onnx:
        return (f"{verdict_path} scored ONNX sha256 {_short(scored)}, but {paths.onnx} is {_short(onnx)}; "
                "run `dvc repro` (make run) so the gate scores this model")  # fmt: skip
    if "baseline_sha256" not in verdict:
        return f"{verdict_path} does not record which baseline it compared against; run `dvc repro` (make run)"
    compared, here = verdict["baseline_sha256"], baseline_sha256(paths.baseline)
    if compared != here:
        return (f"{verdict_path} compared against baseline sha256 {_short(compared)}, but {paths.baseline}/ is now "
                f"{_short(here)}; run `dvc repro` (make run) so the gate compares this model with it")  # fmt: skip
    failed = failed_export_gates(verdict)
    if failed:
        return (f"{verdict_path}: export gate failed: {'; '.join(failed)} (verdict '{verdict.get('verdict')}'); "
                "fix the export (params.yaml export.int8) and run `dvc repro`")  # fmt: skip
    return None
