"""sweep-flow (`make sweep [TRIALS=n] [PARALLEL=k] [STUDY=name]`): an Optuna study over params.yaml's `sweep.space`.

Each trial is a DVC experiment, `dvc exp run -n <study>-t<number> -S key=value ...`, run by a Prefect task in its
own temporary copy of this repository at HEAD (flows/sweep/trial.py), at most `parallel` at once (the flow's
task runner). A trial reports each epoch's validation accuracy; the pruner (flows/sweep/study.py) may stop it
there. The study lives in Optuna's journal under runs/sweep/, so the same command resumes a killed sweep: the
finished and pruned trials are kept, the ones that were running are retried. `sweep.trials` is the study's size,
counted in finished and pruned trials.

At the end it prints the best trial with its `dvc exp apply` line, writes the comparison (a table with each
trial's values, epochs and accuracies; with `sweep.seeds` > 1, the best `rerun_top` configurations rerun with
other seeds, and a gap smaller than the seed spread is marked "within noise"), a plot of each searched value
against validation accuracy, a Prefect artifact of both, and one MLflow parent run with the trials as children.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.trial import TrialState
from prefect import flow, get_run_logger, runtime, task
from prefect.artifacts import create_markdown_artifact
from prefect.task_runners import ThreadPoolTaskRunner

from flows.shell import stage_env
from flows.sweep import report
from flows.sweep.space import SpaceError, check_space, suggest
from flows.sweep.study import SweepBusy, counted, journal_path, open_study, resume, study_lock, study_uid
from flows.sweep.trial import TrialResult, clear_leftovers, core_slots, run_trial, stop_all
from tasks.core.experiment_params import SweepParams
from tasks.core.git import changed_files, head_commit
from tasks.core.io import read_json, write_json
from tasks.core.params import PARAMS_FILE, ParamsError, load_params
from tasks.release import tracking

ARTIFACT_KEY = "sweep-comparison"
MAX_FAILURES_IN_A_ROW = 3  # then the sweep stops, naming the last failure: a broken pipeline fails every trial


class TrialsFailing(RuntimeError):
    """Every trial fails: the pipeline itself is broken at HEAD (the message carries the last trial's log)."""


@dataclass(frozen=True)
class Run:
    """What every trial of one sweep shares."""

    sweep: SweepParams
    repo: Path
    commit: str
    epochs: int  # of the committed run: a trial is not pruned at its last epoch
    env: dict[str, str]
    extra: list[str]  # more -S for every trial (threads, where trials share a machine without CPU affinity)
    uri: str
    experiment: str
    parent: str | None
    seed: int
    slots: list[list[int]] | None = None  # each running trial's CPUs, when trials share the machine
    track: bool = True  # tracking.enabled: the sweep's MLflow parent and its unfinished trials

    @property
    def workdir(self) -> Path:
        return self.repo / "runs" / "sweep" / self.sweep.study

    def submit(self, name: str, number: int, values: dict[str, Any], seed: int | None, tag: str,
               trial: optuna.Trial | None, cores: list[int] | None = None) -> Any:  # fmt: skip
        env = {**self.env, tracking.TRIAL_ENV: tag}
        return trial_task.submit(str(self.repo), str(self.workdir), name, number, values, seed, self.commit, env,
                                 trial, self.extra, self.epochs, cores)  # fmt: skip


@task(name="sweep-trial", task_run_name="{name}", cache_policy=None)
def trial_task(
    repo_dir: str,
    workdir: str,
    name: str,
    number: int,
    values: dict[str, Any],
    seed: int | None,
    commit: str,
    env: dict[str, str],
    trial: optuna.Trial | None = None,
    extra_sets: list[str] | None = None,
    epochs: int = 0,
    cores: list[int] | None = None,
) -> TrialResult:
    """One trial, reporting each epoch to its Optuna `trial` and stopped when it says prune (None: a seed rerun,
    which runs to its end)."""
    logger = get_run_logger()

    def prune(epoch: int, accuracy: float) -> bool:
        if trial is None:
            return False
        trial.report(accuracy, epoch)
        return epoch < epochs and trial.should_prune()  # the last epoch is the result: nothing left to save

    result = TrialResult(number=number, name=name, values=values, seed=seed)
    run_trial(
        Path(repo_dir),
        Path(workdir),
        result,
        commit=commit,
        env=env,
        report=prune,
        log=logger.info,
        extra_sets=extra_sets,
        cores=cores,
    )
    if trial is not None and result.restored:  # its epochs, for the pruner's medians, from the restored history
        for epoch, accuracy in enumerate(result.epochs, start=1):
            trial.report(accuracy, epoch)
    return result


def _epochs(repo: Path) -> int:
    history = repo / "reports" / "train_history.json"
    try:
        return len(read_json(history)) or 1
    except (OSError, ValueError):
        return 1


def _trial_env(uri: str, parent: str | None, study: str) -> dict[str, str]:
    env = stage_env()
    for name in ("DVC_EXP_NAME", "ALLOW_REGRESSION"):
        env.pop(name, None)
    env["MLFLOW_TRACKING_URI"] = uri
    if parent:
        env[tracking.PARENT_ENV] = parent
    env[tracking.TRIAL_ENV] = study
    with contextlib.suppress(Exception):  # outside a flow run there is none to name
        env["PREFECT__FLOW_RUN_ID"] = str(runtime.flow_run.id)
    return env


def _result_of(trial: Any) -> TrialResult:
    """A trial of an earlier (resumed) sweep, from what the journal kept."""
    attrs = trial.user_attrs
    state = {TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned"}.get(trial.state, "failed")
    epochs = [trial.intermediate_values[k] for k in sorted(trial.intermediate_values)]
    return TrialResult(
        number=trial.number,
        name=attrs.get("name", f"t{trial.number}"),
        values=dict(trial.params),
        seed=None,
        state=state,
        epochs=epochs,
        val_accuracy=trial.value,
        test_accuracy=attrs.get("test_accuracy"),
        verdict=attrs.get("verdict"),
    )


@flow(name="sweep-flow", log_prints=True)
def sweep_flow(trials: int | None = None, parallel: int | None = None, study_name: str | None = None) -> dict[str, Any]:
    """Run the study to `trials` finished or pruned trials, `parallel` at once; print and publish the comparison."""
    logger = get_run_logger()
    repo = Path.cwd()
    params = load_params(repo / PARAMS_FILE)
    update = {k: v for k, v in (("trials", trials), ("parallel", parallel), ("study", study_name)) if v is not None}
    sweep = SweepParams.model_validate({**params.sweep.model_dump(), **update})  # a deployment's values checked too
    check_space(yaml.safe_load((repo / PARAMS_FILE).read_text()) or {}, sweep.space)  # before any trial
    commit = head_commit(repo)
    if commit is None:
        raise RuntimeError(f"{repo} has no git commit: trials are clones of HEAD, so commit the project first")
    if changed_files(repo, "params.yaml", "tasks", "dvc.yaml"):
        logger.warning(
            "trials start from the commit %s: uncommitted changes to params.yaml, dvc.yaml or tasks/ "
            "are not in them (commit them first to search from them)",
            commit[:12],
        )
    runs = repo / params.paths.runs
    epochs = _epochs(repo)
    uri = tracking.tracking_uri(tracking.project_root(repo))
    workdir = runs / "sweep" / sweep.study
    with study_lock(runs, sweep.study):
        leftovers = clear_leftovers(workdir)
        if leftovers:
            logger.info("removed %d trial copies a killed sweep left in %s", len(leftovers), workdir)
        study = open_study(runs, sweep, epochs)
        retried = resume(study)
        if retried:
            logger.info(
                "resuming study %s: trials %s were running when it stopped; their values run again",
                sweep.study,
                retried,
            )
        # The sweep's own MLflow calls fail in seconds on an unreachable server, as the gate's do (mlflow_store)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        parent = (
            None
            if not params.tracking.enabled
            else report.parent_run(
                uri, params.tracking.experiment, sweep.study, study_uid(study), journal_path(runs, sweep.study)
            )
        )
        # Trials sharing the machine get disjoint CPUs, so train.threads 0 counts its own and the experiment
        # that `dvc exp apply` brings back holds only the searched values; without CPU affinity (macOS), threads.
        slots = core_slots(sweep.parallel) if sweep.parallel > 1 else None
        cores = os.cpu_count() or 1
        extra = ["-S", f"train.threads={max(1, cores // sweep.parallel)}"] if sweep.parallel > 1 and not slots else []
        run = Run(sweep, repo, commit, epochs, _trial_env(uri, parent, sweep.study), extra, uri,
                  params.tracking.experiment, parent, params.seed, slots, params.tracking.enabled)  # fmt: skip
        try:
            results = _run_study(study, run)
            reruns = _rerun_seeds(study, run)
        except BaseException:  # Ctrl-C, or the flow failing: no trial outlives the sweep
            stopped = stop_all()
            if stopped:
                logger.warning("stopped %d running trials; the same command retries them", stopped)
            raise
        return _conclude(study, run, results, reruns, logger)


def _run_study(study: optuna.Study, run: Run) -> list[TrialResult]:
    sweep = run.sweep
    logger = get_run_logger()
    running: dict[int, tuple[optuna.Trial, Any]] = {}
    slot_of: dict[int, int] = {}  # a running trial's slot in run.slots
    results: list[TrialResult] = []
    failures = 0  # in a row: a failed trial is replaced, but not forever
    while counted(study) + len(running) < sweep.trials or running:
        while (len(running) < sweep.parallel and counted(study) + len(running) < sweep.trials
               and failures < MAX_FAILURES_IN_A_ROW):  # fmt: skip
            trial = study.ask()
            values = suggest(trial, sweep.space)
            name = f"{sweep.study}-t{trial.number:03d}"
            trial.set_user_attr("name", name)
            logger.info("trial %s: %s", name, values)
            cores = None
            if run.slots:
                slot_of[trial.number] = min(set(range(len(run.slots))) - set(slot_of.values()))
                cores = run.slots[slot_of[trial.number]]
            future = run.submit(name, trial.number, values, None, f"{sweep.study}:{trial.number}", trial, cores)
            running[trial.number] = (trial, future)
        done = [n for n, (_, f) in running.items() if f.wrapped_future.done()]  # local threads: no API polling
        if not running:  # nothing asked: the trials keep failing
            raise TrialsFailing(f"{failures} trials in a row failed; the last: {results[-1].message}")
        if not done:
            time.sleep(1.0)
            continue
        for number in done:
            trial, future = running.pop(number)
            slot_of.pop(number, None)
            result: TrialResult = future.result()
            results.append(result)
            _tell(study, trial, result)
            if result.state != "complete" and run.track:
                report.log_unfinished(run.uri, run.experiment, run.parent, sweep.study, result)
            logger.info(
                "trial %s %s in %.0f s: %s",
                result.name,
                result.state,
                result.seconds,
                result.message.splitlines()[0] if result.message else "",
            )
            failures = failures + 1 if result.state == "failed" else 0
            if result.state == "failed":
                logger.warning("trial %s failed:\n%s", result.name, result.message)
    return results


def _tell(study: optuna.Study, trial: optuna.Trial, result: TrialResult) -> None:
    attrs = {"test_accuracy": result.test_accuracy, "verdict": result.verdict, "seconds": result.seconds}
    for key, value in attrs.items():
        if value is not None:
            trial.set_user_attr(key, value)
    if result.state == "complete":
        study.tell(trial, result.val_accuracy)
    elif result.state == "pruned":
        study.tell(trial, state=TrialState.PRUNED)
    else:
        study.tell(trial, state=TrialState.FAIL)


def _rerun_seeds(study: optuna.Study, run: Run) -> dict[str, list[float]]:
    """sweep.seeds > 1: the best rerun_top configurations, each again with seeds seed+1 .. seed+seeds-1 (kept in
    runs/sweep/<study>.seeds.json, so a resumed sweep reruns only what is missing)."""
    sweep, seed = run.sweep, run.seed
    path = run.repo / "runs" / "sweep" / f"{sweep.study}.seeds.json"
    done: dict[str, dict[str, float]] = read_json(path) if path.is_file() else {}
    if sweep.seeds <= 1:
        return {}
    best = sorted(
        (t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE), key=lambda t: -t.value
    )[: sweep.rerun_top]
    logger = get_run_logger()
    for trial in best:
        name = trial.user_attrs.get("name", f"{sweep.study}-t{trial.number:03d}")
        for k in range(1, sweep.seeds):
            if str(seed + k) in done.get(name, {}):
                continue
            rerun = f"{name}-seed{seed + k}"
            logger.info("seed rerun %s: %s with seed %d", rerun, dict(trial.params), seed + k)
            tag = f"{sweep.study}:{trial.number}:seed{seed + k}"
            future = run.submit(rerun, trial.number, dict(trial.params), seed + k, tag, None)
            result = future.result()
            if result.state == "complete" and result.val_accuracy is not None:
                done.setdefault(name, {})[str(seed + k)] = result.val_accuracy
                write_json(path, done)
            else:
                logger.warning("seed rerun %s %s: %s", rerun, result.state, result.message)
    return {name: list(values.values()) for name, values in done.items()}


def _conclude(
    study: optuna.Study, run: Run, results: list[TrialResult], reruns: dict[str, list[float]], logger: Any
) -> dict[str, Any]:
    sweep, epochs, runs = run.sweep, run.epochs, run.repo / "runs"
    mine = {r.number for r in results}
    earlier = [
        _result_of(t)
        for t in study.get_trials(deepcopy=False)
        if t.number not in mine and t.state in (TrialState.COMPLETE, TrialState.PRUNED)
    ]
    everything = sorted([*earlier, *results], key=lambda r: r.number)
    table = report.comparison_table(everything, reruns, epochs)
    ran, full = report.pruning_savings(everything, epochs)
    plot = report.plot_params(everything, sweep.space, runs / "sweep" / sweep.study / "params.png")
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
    report.close_parent(run.uri, run.parent, best, plot, table)
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


def _positive(name: str, text: str | None) -> int | None:
    if text is None or text == "":
        return None
    if not text.isdigit() or int(text) < 1:
        print(f"error: {name}={text} is not a positive integer: make sweep {name}=3", file=sys.stderr)
        sys.exit(2)
    return int(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", help="the study's size in finished or pruned trials (default sweep.trials)")
    parser.add_argument("--parallel", help="trials at once (default sweep.parallel)")
    parser.add_argument("--study", help="the study's name (default sweep.study)")
    args = parser.parse_args(argv)
    trials, parallel = _positive("TRIALS", args.trials), _positive("PARALLEL", args.parallel)
    try:
        params = load_params(PARAMS_FILE)
        check_space(yaml.safe_load(PARAMS_FILE.read_text()) or {}, params.sweep.space)
        with study_lock(params.paths.runs, args.study or params.sweep.study):
            pass  # a sweep of this study already running is refused here, in one line, before Prefect starts
        k = parallel or params.sweep.parallel
        sweep_flow.with_options(task_runner=ThreadPoolTaskRunner(max_workers=k))(trials, parallel, args.study)
    except (SpaceError, ParamsError, SweepBusy) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except TrialsFailing as exc:
        print(f"error: sweep stopped: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
