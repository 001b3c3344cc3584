"""What a sweep leaves to read: MLflow runs (one parent, the trials as children), a comparison table that knows
its seed noise, and a plot of each searched param against validation accuracy.

A finished trial's own MLflow run is logged by its gate (tasks/release/tracking.py, a child through
IMAGEPIPE_MLFLOW_PARENT; copied into the project's store by flows/sweep/store.py); a pruned or failed trial never
reaches the gate, so the sweep logs it here, with its values, the epochs it ran and its state. Every write holds
the store's lock (store.py); every MLflow call is best effort: one warning line, never the sweep.
"""

from __future__ import annotations

import io
import logging
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flows.sweep.store import Store
from flows.sweep.trial import TrialResult
from tasks.core.experiment_params import SearchRange
from tasks.release import mlflow_store

log = logging.getLogger(__name__)

PARENT_TAG = "sweep.parent"  # the study's name
UID_TAG = "sweep.uid"  # the study's identity (its journal's)


def _warn(what: str, exc: Exception) -> None:
    log.warning(
        "warning: MLflow %s not written (%s: %s); the sweep goes on",
        what,
        type(exc).__name__,
        str(exc).strip().splitlines()[0][:300] if str(exc).strip() else "",
    )


def parent_run(store: Store, experiment: str, study: str, uid: str, journal: Path) -> str | None:
    """The sweep's parent run: the one this study already has (a resumed sweep), or a new one. A study is
    known by its journal's uid, not its name: a study started again after its journal was deleted is a new
    sweep with a parent of its own."""
    try:
        with store.writing():
            return _parent_run(store.uri, experiment, study, uid, journal)
    except Exception as exc:  # noqa: BLE001
        _warn("parent run", exc)
        return None


def _parent_run(uri: str, experiment: str, study: str, uid: str, journal: Path) -> str:
    client = mlflow_store.client(uri)
    exp_id = mlflow_store.experiment_id(client, experiment, uri)
    found = client.search_runs([exp_id], filter_string=f"tags.`{UID_TAG}` = '{uid}'", max_results=1)
    if found:
        client.update_run(found[0].info.run_id, status="RUNNING")
        return found[0].info.run_id
    run = client.create_run(
        exp_id,
        run_name=f"sweep {study}",
        tags={PARENT_TAG: study, UID_TAG: uid, "sweep.journal": str(journal), "source": "make sweep"},
    )
    return run.info.run_id


def log_unfinished(store: Store, experiment: str, parent: str | None, study: str, result: TrialResult) -> None:
    """A pruned or failed trial as a child run: its values, its epochs' validation accuracy, its state."""
    try:
        with store.writing():
            _log_unfinished(store.uri, experiment, parent, study, result)
    except Exception as exc:  # noqa: BLE001
        _warn(f"run of trial {result.name}", exc)


def _log_unfinished(uri: str, experiment: str, parent: str | None, study: str, result: TrialResult) -> None:
    from mlflow.entities import Metric, Param

    client = mlflow_store.client(uri)
    exp_id = mlflow_store.experiment_id(client, experiment, uri)
    trial_tag = f"{study}:{result.number}"
    tags = {
        "sweep.trial": trial_tag,
        "sweep.state": result.state,
        "source": "make sweep",
        "sweep.message": result.message[:5000],
    }
    # A trial that failed after its gate (its experiment could not be fetched) has its run under this
    # sweep's parent already: marked failed, not doubled
    mine = f"tags.`sweep.trial` = '{trial_tag}' and tags.`mlflow.parentRunId` = '{parent}'"
    logged = client.search_runs([exp_id], filter_string=mine, max_results=1) if parent else []
    if logged:
        for key in ("sweep.state", "sweep.message"):
            client.set_tag(logged[0].info.run_id, key, tags[key])
        client.set_terminated(logged[0].info.run_id, "FAILED")
        return
    if parent:
        tags["mlflow.parentRunId"] = parent
    run = client.create_run(exp_id, run_name=result.name, tags=tags)
    now = run.info.start_time
    values = {**result.values, **({"seed": result.seed} if result.seed is not None else {})}
    metrics = [Metric("val_accuracy", acc, now, epoch) for epoch, acc in enumerate(result.epochs, start=1)]
    metrics.append(Metric("epochs_run", float(len(result.epochs)), now, 0))
    client.log_batch(run.info.run_id, metrics=metrics, params=[Param(k, str(v)) for k, v in values.items()])
    client.set_terminated(run.info.run_id, "KILLED" if result.state == "pruned" else "FAILED")


def close_parent(store: Store, parent: str | None, best: TrialResult | None, plot: Path | None, table: str) -> None:
    if parent is None:
        return
    try:
        with store.writing():
            _close_parent(store.uri, parent, best, plot, table)
    except Exception as exc:  # noqa: BLE001
        _warn("parent run", exc)


def _close_parent(uri: str, parent: str, best: TrialResult | None, plot: Path | None, table: str) -> None:
    from mlflow.entities import Metric, RunTag

    client = mlflow_store.client(uri)
    if best is not None and best.val_accuracy is not None:
        now = client.get_run(parent).info.start_time
        metrics = [Metric("best_val_accuracy", best.val_accuracy, now, 0)]
        if best.test_accuracy is not None:
            metrics.append(Metric("best_test_accuracy", best.test_accuracy, now, 0))
        # tags, not params: a param is written once, and a resumed sweep may find a better trial
        tags = [RunTag(f"best.{k}", str(v)) for k, v in best.values.items()]
        tags.append(RunTag("sweep.best", best.name))
        client.log_batch(parent, metrics=metrics, tags=tags)
    if plot is not None and plot.is_file():
        client.log_artifact(parent, str(plot))
    client.log_text(parent, table, "comparison.md")
    client.set_terminated(parent, "FINISHED")


def seed_stats(runs: Sequence[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None with one seed)."""
    return statistics.fmean(runs), (statistics.stdev(runs) if len(runs) > 1 else None)


def noise_marks(groups: dict[str, list[float]]) -> dict[str, str]:
    """Per configuration, against the best mean: 'best', 'within noise' (the gap is smaller than the larger of the
    two seed spreads) or 'worse by X (beyond the seed spread S)'. With one seed there is no spread: 'one seed'."""
    stats = {name: seed_stats(values) for name, values in groups.items() if values}
    if not stats:
        return {}
    best = max(stats, key=lambda name: stats[name][0])
    marks = {best: "best"}
    for name, (mean, spread) in stats.items():
        if name == best:
            continue
        spreads = [s for s in (spread, stats[best][1]) if s is not None]
        gap = stats[best][0] - mean
        if not spreads:
            marks[name] = f"worse by {gap:.4f} (one seed: spread unknown)"
        elif gap < max(spreads):
            marks[name] = "within noise"
        else:
            marks[name] = f"worse by {gap:.4f} (beyond the seed spread {max(spreads):.4f})"
    return marks


def _value(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _reached(result: TrialResult) -> float:
    """The validation accuracy a trial reached: its objective, or the last epoch a pruned one ran."""
    if result.val_accuracy is not None:
        return result.val_accuracy
    return result.epochs[-1] if result.epochs else 0.0


def comparison_table(results: Sequence[TrialResult], reruns: dict[str, list[float]], epochs: int) -> str:
    """Markdown: every trial, best first; with seed reruns, mean ± spread and the noise mark of each rerun config."""
    keys = sorted({k for r in results for k in r.values})
    order = sorted(results, key=lambda r: (r.state != "complete", -_reached(r)))
    groups = {
        name: [next(r.val_accuracy for r in results if r.name == name), *runs]
        for name, runs in reruns.items()
        if any(r.name == name and r.val_accuracy is not None for r in results)
    }
    marks = noise_marks(groups)
    head = ["trial", "state", *keys, "epochs", "val accuracy", "test accuracy", "seeds: mean ± spread", "vs best"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in order:
        seeds = ""
        if r.name in groups:
            mean, spread = seed_stats(groups[r.name])
            seeds = f"{mean:.4f} ± {spread:.4f} ({len(groups[r.name])})" if spread is not None else f"{mean:.4f} (1)"
        val = (
            f"{r.val_accuracy:.4f}"
            if r.val_accuracy is not None
            else (f"{r.epochs[-1]:.4f} (epoch {len(r.epochs)})" if r.epochs else "")
        )
        row = [
            r.name,
            r.state,
            *(_value(r.values.get(k, "")) for k in keys),
            f"{len(r.epochs)}/{epochs}",
            val,
            f"{r.test_accuracy:.4f}" if r.test_accuracy is not None else "",
            seeds,
            marks.get(r.name, ""),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def pruning_savings(results: Sequence[TrialResult], epochs: int) -> tuple[int, int]:
    """(epochs trained, epochs the same trials would have trained unpruned)."""
    ran = sum(len(r.epochs) if r.state == "pruned" else epochs for r in results if r.state in ("complete", "pruned"))
    full = epochs * sum(r.state in ("complete", "pruned") for r in results)
    return ran, full


def plot_params(results: Sequence[TrialResult], space: dict[str, SearchRange], path: Path) -> Path | None:
    """One panel per searched param: its value against validation accuracy (pruned: the last epoch reached)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in results if r.val_accuracy is not None or r.epochs]
    if not shown or not space:
        return None
    fig, axes = plt.subplots(1, len(space), figsize=(4 * len(space), 3.4), squeeze=False)
    for ax, (key, spec) in zip(axes[0], space.items(), strict=True):
        for state, marker, colour in (("complete", "o", "tab:blue"), ("pruned", "x", "tab:grey")):
            pts = [
                (r.values[key], r.val_accuracy if r.val_accuracy is not None else r.epochs[-1])
                for r in shown
                if r.state == state and key in r.values
            ]
            if pts and spec.choices is None:
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, c=colour, label=state)
            elif pts:
                ax.scatter([str(p[0]) for p in pts], [p[1] for p in pts], marker=marker, c=colour, label=state)
        if spec.log:
            ax.set_xscale("log")
        ax.set_xlabel(key)
        ax.set_ylabel("validation accuracy")
        ax.grid(alpha=0.3)
    axes[0][0].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    path.write_bytes(buffer.getvalue())
    return path
