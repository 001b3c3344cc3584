"""What a sweep ends with: every trial of the study (this sweep's and a resumed study's earlier ones) compared
in one table, with the pruning's savings and the plot; published as a Prefect artifact and on the MLflow parent,
printed, and the best trial named with the command that applies it."""

from __future__ import annotations

import base64
from typing import Any

import optuna
from optuna.trial import TrialState
from prefect.artifacts import create_markdown_artifact

from flows.sweep import report
from flows.sweep.scheduler import Run
from flows.sweep.study import trial_name
from flows.sweep.trial import TrialResult

ARTIFACT_KEY = "sweep-comparison"


def result_of(trial: Any, study_name: str) -> TrialResult:
    """A trial of an earlier (resumed) sweep, from what the journal kept."""
    attrs = trial.user_attrs
    state = {TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned"}.get(trial.state, "failed")
    epochs = [trial.intermediate_values[k] for k in sorted(trial.intermediate_values)]
    return TrialResult(
        number=trial.number,
        name=trial_name(study_name, trial),
        values=dict(trial.params),
        seed=None,
        state=state,
        epochs=epochs,
        val_accuracy=trial.value,
        test_accuracy=attrs.get("test_accuracy"),
        verdict=attrs.get("verdict"),
    )


def conclude(
    study: optuna.Study, run: Run, results: list[TrialResult], reruns: dict[str, list[float]], logger: Any
) -> dict[str, Any]:
    sweep, epochs = run.sweep, run.epochs
    mine = {r.number for r in results}
    earlier = [
        result_of(t, sweep.study)
        for t in study.get_trials(deepcopy=False)
        if t.number not in mine and t.state in (TrialState.COMPLETE, TrialState.PRUNED)
    ]
    everything = sorted([*earlier, *results], key=lambda r: r.number)
    table = report.comparison_table(everything, reruns, epochs)
    ran, full = report.pruning_savings(everything, epochs)
    plot = report.plot_params(everything, sweep.space, run.workdir / "params.png")
    complete = [r for r in everything if r.state == "complete" and r.val_accuracy is not None]
    best = max(complete, key=lambda r: r.val_accuracy or 0.0) if complete else None
    saved = f"pruning saved {full - ran} of {full} trial-epochs ({(full - ran) / full:.0%})" if full else ""
    summary = [
        f"# Sweep `{sweep.study}`",
        "",
        f"{len(everything)} trials ({saved}); pruner {sweep.pruner}, TPE seed {sweep.sampler_seed}",
        "",
        table,
    ]
    if plot is not None:
        encoded = base64.b64encode(plot.read_bytes()).decode()
        summary += ["", f"![each searched value against validation accuracy](data:image/png;base64,{encoded})"]
    markdown = "\n".join(summary)
    try:
        create_markdown_artifact(markdown, key=ARTIFACT_KEY, description=f"sweep {sweep.study}: trials compared")
    except Exception as exc:  # noqa: BLE001 - the comparison is also printed and in MLflow
        logger.warning("could not publish the comparison artifact: %s", exc)
    report.close_parent(run.store, run.parent, best, plot, table)
    print(table)
    if saved:
        print(saved)
    if best is None:
        print(f"no trial of study {sweep.study} finished: nothing to apply")
        return {"best": None, "trials": len(everything)}
    values = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in best.values.items())
    print(
        f"best trial: {best.name} ({values}): validation accuracy {best.val_accuracy:.4f}"
        + (f", test accuracy {best.test_accuracy:.4f}" if best.test_accuracy is not None else "")
    )
    print(f"  apply it: dvc exp apply {best.name}   (then make run && make commit-run, and make promote)")
    return {"best": best.name, "values": best.values, "val_accuracy": best.val_accuracy, "trials": len(everything)}
