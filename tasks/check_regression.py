"""Stage check_regression: exported ONNX (hash-verified) + test shards + baseline/ -> regression.json, .md.

The model that ships and the promoted baseline's model (baseline/model.onnx, hash-verified against
baseline/model.json: a file that fails is refused, never re-scored or skipped) are both scored through the
serving path (tasks.release.inference) on today's test split, image by image, and compared under
params.yaml's rules with a paired test on the same images (tasks.release.verdict); the export's deferred gates
(INT8 vs fp32, recorded in export.json) are part of the same verdict. The baseline side is the baseline as
re-scored today, so images added to the test split since the promotion are compared too, and the verdict says
how many (baseline/test_set.json, written by `make promote`, lists the promoted test images).
baseline/metrics.json (its metrics at promotion) says that a baseline exists and is shown beside the re-scored
figures; a baseline promoted before model.onnx was kept is compared with it on the tolerances alone.

Exits 1 on any failed rule or gate, and on a baseline that cannot be scored on these shards (other classes or
another image size: one `different test set` line; only then is `make promote` needed), except inside
`dvc exp run`: there the verdict is recorded in reports/gate.json, a DVC metric that `dvc exp show`
lists, and the experiment is kept. With no baseline yet the baseline rules pass and say so.

The stage is `always_changed` in dvc.yaml: whether the gate is enforced is decided when it runs, so
`dvc repro` and `dvc repro -s check_regression` after an experiment enforce the verdict the experiment
only recorded, and no DVC skip or run cache stands in for the gate. Scoring the test split is the
costly part: each model's scores are kept and reused when nothing they depend on changed
(tasks/release/score_cache.py); the comparison is made again every time.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from tasks.core.cli import stage_main
from tasks.core.environment import dvc_experiment
from tasks.core.errors import StageError
from tasks.core.io import atomic_file, read_json, write_json
from tasks.core.params import Params, RegressionParams
from tasks.core.paths import BASELINE_METRICS, BASELINE_ONNX
from tasks.core.provenance import project_root, stage_code
from tasks.images.shards import load_manifest
from tasks.release import tracking
from tasks.release.gate import ACCEPT_COMMAND
from tasks.release.paired import Paired
from tasks.release.parity import Check
from tasks.release.production import (
    BASELINE_TEST_SET,
    baseline_model,
    baseline_sha256,
    load_baseline,
    load_promoted_test_set,
)
from tasks.release.score_cache import score_baseline, score_candidate
from tasks.release.scoring import SplitScores
from tasks.release.verdict import Verdict, compare
from tasks.release.verdict_table import format_table

log = logging.getLogger(__name__)
_LISTED = 20  # failed rows printed on a failed gate; regression.md has every row


def export_gates(export_report: Path) -> tuple[Check, ...]:
    """The gates export measured but left to this verdict (onnx_int8.gates in export.json), judged
    again here from value, operator and limit: a recorded `passed` is not taken on trust."""
    raw = read_json(export_report).get("onnx_int8", {}).get("gates", [])
    gates = []
    for i, gate in enumerate(raw):
        ok = isinstance(gate, dict) and all(isinstance(gate.get(k), str) for k in ("name", "param"))
        ok = ok and gate.get("op") in (">=", "<=")
        ok = ok and all(isinstance(gate.get(k), int | float) and not isinstance(gate.get(k), bool)
                        for k in ("value", "limit"))  # fmt: skip
        if not ok:
            raise StageError(f"{export_report}: onnx_int8.gates.{i} is not a gate record (got {gate!r})")
        gates.append(Check(gate["name"], float(gate["value"]), gate["op"], float(gate["limit"]), gate["param"]))
    return tuple(gates)


def gate_record(verdict: Verdict, *, enforced: bool) -> dict[str, Any]:
    """reports/gate.json, a DVC metric: `verdict` the one status word make commit-run and promote check; `headline`
    the same with the rules not judged ("pass, 11 of 12 rules not judged"), MLflow's gate.verdict."""
    return {"verdict": verdict.status, "headline": verdict.headline, "passed": verdict.passed, "enforced": enforced,
            "not_judged": len(verdict.too_few), "rules": len(verdict.results),
            "summary": verdict.summary()}  # fmt: skip


def promoted_set_change(baseline_dir: Path, today: SplitScores, class_names: tuple[str, ...]) -> dict[str, Any]:
    """Today's test images against the promoted ones (baseline/test_set.json): how many, how many new, no longer
    in it, relabelled; `new` is None for a baseline promoted before the file was written."""
    promoted = load_promoted_test_set(baseline_dir)
    change: dict[str, Any] = {"images": len(today.images), "new": None, "no_longer": None, "relabelled": None}
    if promoted is not None:
        change["new"] = sum(image not in promoted for image in today.images)
        change["no_longer"] = len(set(promoted) - set(today.images))
        change["relabelled"] = sum(image in promoted and promoted[image] != class_names[label]
                                   for image, label in zip(today.images, today.labels, strict=True))  # fmt: skip
    return change


def rescored_note(change: dict[str, Any], baseline_dir: Path) -> str:
    """`baseline re-scored on today's test set: N images, M new` (and what else changed since the promotion)."""
    if change["new"] is None:
        return (f"baseline re-scored on today's test set: {change['images']} images, new ones unknown "
                f"({baseline_dir / BASELINE_TEST_SET} absent: promoted before it was recorded)")  # fmt: skip
    parts = [f"{change['images']} images, {change['new']} new"]
    parts += [f"{change['no_longer']} promoted ones no longer in it"] if change["no_longer"] else []
    parts += [f"{change['relabelled']} relabelled since the promotion"] if change["relabelled"] else []
    return "baseline re-scored on today's test set: " + ", ".join(parts)


def _rescored_header(onnx_path: Path, onnx_sha256: str, baseline_onnx: Path, rescored: dict[str, Any],
                     recorded: dict[str, Any], baseline_path: Path) -> str:  # fmt: skip
    """regression.md's first line when both models were scored today: which files, and the baseline's accuracy
    today beside the one recorded at its promotion (baseline/metrics.json)."""
    today, then = rescored["metrics"], recorded.get("accuracy")
    then_text = f"{then:.4f}" if isinstance(then, int | float) and not isinstance(then, bool) else "-"
    return (f"`{onnx_path}` (sha256 `{onnx_sha256}`) and the baseline `{baseline_onnx}` (sha256 "
            f"`{rescored['onnx_sha256']}`), both scored on today's test split. The baseline's accuracy: "
            f"{today['accuracy']:.4f} on {today['num_samples']} images today, {then_text} on "
            f"{recorded.get('num_samples', '?')} images at its promotion (`{baseline_path}`)")  # fmt: skip


def run(
    params: RegressionParams,
    *,
    onnx_path: Path,
    export_report: Path,
    shard_dir: Path,
    baseline_dir: Path,
    verdict_path: Path,
    table_path: Path,
    gate_path: Path,
    scores_path: Path | None = None,
    baseline_scores_path: Path | None = None,
    environment_record: Path | None = None,
) -> Verdict:
    candidate = score_candidate(params, onnx_path, export_report, shard_dir, scores_path, environment_record)
    metrics = candidate.scores.metrics
    recorded = load_baseline(baseline_dir)
    promoted = baseline_model(baseline_dir)
    baseline_path = baseline_dir / BASELINE_METRICS
    rescored: dict[str, Any] | None = None
    if promoted is not None and recorded is None:
        raise StageError(f"{baseline_path}: missing beside {promoted.path}; promote again (make promote)")
    if recorded is None:
        verdict = compare(metrics, None, params.rules)
    elif promoted is None:  # promoted before the model was kept beside its metrics: no paired test possible
        note = (f"{baseline_dir / BASELINE_ONNX} absent: compared with the recorded {baseline_path} on the "
                "tolerances alone, no paired test; promote a model (make promote) to re-score it")  # fmt: skip
        verdict = compare(metrics, recorded, params.rules, baseline_note=note)
    else:
        scored = score_baseline(params, promoted, shard_dir, baseline_scores_path, environment_record, candidate,
                                 recorded)  # fmt: skip
        if isinstance(scored, str):
            verdict = Verdict(passed=False, has_baseline=True, results=(), mismatch=scored)
        else:
            names = tuple(load_manifest(shard_dir)["class_names"])  # the order of the predicted indices
            change = promoted_set_change(baseline_dir, candidate.scores, names)
            paired = Paired(candidate.scores.labels, candidate.scores.predicted, scored.scores.predicted, names)
            verdict = compare(metrics, scored.scores.metrics, params.rules, paired=paired, alpha=params.alpha,
                              baseline_note=rescored_note(change, baseline_dir), unjudged=params.unjudged,
                              whole_share=params.whole_share)  # fmt: skip
            rescored = {"onnx_sha256": scored.onnx_sha256, "metrics": scored.scores.metrics,
                        "scored": {"key": scored.key}, "test_set": change}  # fmt: skip
    verdict = verdict.with_gates(export_gates(export_report))
    write_json(
        verdict_path,
        {
            **verdict.to_json(),
            "baseline": str(baseline_path),
            "baseline_sha256": baseline_sha256(baseline_dir),  # what make promote and commit-run check it against
            "baseline_rescored": rescored,  # the baseline model on today's test split: the verdict's baseline side
            "model": {"path": str(onnx_path), "onnx_sha256": candidate.onnx_sha256},
            "metrics": metrics,
            "scored": {"key": candidate.key},  # the inputs the metrics were scored from (score_cache.scoring_key)
            # the rules and the code that judged: a failed verdict is this workspace's only while both are as here
            # (tasks/tools/record.py), since DVC records no check_regression for it
            "judged_by": {
                "regression": params.model_dump(mode="json"),
                "code": stage_code("check_regression", project_root()),
            },
        },
    )
    write_json(gate_path, gate_record(verdict, enforced=dvc_experiment() is None))
    table = format_table(verdict)
    header = f"`{onnx_path}` (sha256 `{candidate.onnx_sha256}`), scored on the test split, vs `{baseline_path}`"
    if rescored is not None and promoted is not None and recorded is not None:
        header = _rescored_header(onnx_path, candidate.onnx_sha256, promoted.path, rescored, recorded, baseline_path)
    with atomic_file(table_path, "w") as handle:
        handle.write(f"# Regression check\n\n{header}\n\n{format_table(verdict, markdown=True)}\n")
    log.info("%s (accuracy %.4f on %d test images) vs %s\n%s", onnx_path, metrics["accuracy"],
             metrics["num_samples"], baseline_dir, table)  # fmt: skip
    return verdict


def _main(p: Params) -> int:
    verdict = run(
        p.regression,
        onnx_path=p.paths.onnx,
        export_report=p.paths.export_report,
        shard_dir=p.paths.shards,
        baseline_dir=p.paths.baseline,
        verdict_path=p.paths.regression_json,
        table_path=p.paths.regression_md,
        gate_path=p.paths.gate,
        scores_path=p.paths.runs / "check_regression" / "scores.json",
        baseline_scores_path=p.paths.runs / "check_regression" / "baseline_scores.json",
        environment_record=p.paths.environment_record("check_regression"),
    )
    tracking.mirror(p)  # one MLflow run per record, pass or fail; a broken store costs a warning, never the gate
    if verdict.passed:  # rules not judged pass, but not in silence
        (log.warning if verdict.too_few else log.info)("%s", verdict.summary())
        return 0
    failures = verdict.failures if not verdict.mismatch else ()
    details = "".join(f"\n  {r.describe()}" for r in failures[:_LISTED])
    if len(failures) > _LISTED:
        details += f"\n  ... and {len(failures) - _LISTED} more ({p.paths.regression_md})"
    experiment = dvc_experiment()
    if experiment:
        # An experiment explores: a failed stage would make `dvc exp run` keep nothing, metrics included.
        log.warning("%s%s\nexperiment %s: verdict '%s' recorded in %s (dvc exp show), not enforced; `dvc repro`, "
                    "make run, train-flow/prod and the nightly enforce it", verdict.summary(), details, experiment,
                    verdict.status, p.paths.gate)  # fmt: skip
        return 0
    accept = f"\n  fix the model, or make it the baseline anyway, saying why: {ACCEPT_COMMAND}"
    # a mismatch's summary names the command itself; a verdict not judged, its own remedies
    accept = "" if verdict.mismatch or verdict.status == "not judged" else accept
    print(f"[check_regression] {verdict.summary()}{details}{accept}", file=sys.stderr)
    return 1


def main() -> None:
    stage_main("check_regression", _main)


if __name__ == "__main__":
    main()
