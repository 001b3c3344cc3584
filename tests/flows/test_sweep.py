"""make sweep: an Optuna study whose trials are DVC experiments in their own copies, on a real Prefect server,
real DVC and real MLflow, in a tiny project. The space is checked before any trial; a second sweep of the same
study is refused; a pruned trial leaves nothing; the best trial can be applied with `dvc exp apply`."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from optuna.distributions import FloatDistribution

from flows.sweep import report
from flows.sweep.seeds import rerun_seeds, seeds_path
from flows.sweep.space import SpaceError, check_space
from flows.sweep.store import Store
from flows.sweep.study import SweepBusy, open_study, study_lock, study_uid
from flows.sweep.trial import TrialResult
from tasks.core.experiment_params import SearchRange
from tasks.core.params import load_params
from tasks.release import tracking
from tests.helpers.folders import make_imagefolder
from tests.helpers.project import ROOT, commit, dvc, make_project, sh

SPACE = {"train.lr": {"low": 0.000001, "high": 0.2, "log": True}}


def _space(raw: dict[str, Any]) -> dict[str, SearchRange]:
    return {k: SearchRange.model_validate(v) for k, v in raw.items()}


@pytest.mark.fast
def test_a_space_that_params_yaml_does_not_take_is_refused_in_one_line() -> None:
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    check_space(raw, load_params(ROOT / "params.yaml").sweep.space)  # the shipped space passes
    cases = [
        ("train.learning_rate", {"low": 0.01, "high": 0.1}, "params.yaml has no key train.learning_rate"),
        ("train.optimizer", {"low": 0, "high": 1}, "train.optimizer=0 from its integer range is not a value"),
        ("train.augment.crop_padding", {"low": 0.5, "high": 4.5}, "crop_padding=0.5 from its range is not a value"),
        ("train.arch", {"choices": ["resnet18", "VGG-16"]}, "train.arch='VGG-16' from its choice is not a value"),
        ("train.arch", {"choices": ["resnet18", "vgg"]}, "'vgg' from its choice is not a model .*nearest: vgg"),
    ]
    for key, spec, words in cases:
        with pytest.raises(SpaceError, match=words.replace("(", r"\(")) as caught:
            check_space(raw, _space({key: spec}))
        assert "\n" not in str(caught.value)
    for bad in ({"low": 0.1, "high": 0.01}, {"low": 0.0, "high": 1.0, "log": True}, {"low": 1}):
        with pytest.raises(ValueError):
            SearchRange.model_validate(bad)


@pytest.mark.fast
def test_a_second_sweep_of_the_same_study_is_refused_and_a_dead_ones_lock_is_free(tmp_path: Path) -> None:
    with study_lock(tmp_path, "s"):
        with pytest.raises(SweepBusy, match=r"sweep 's' is already running \(pid \d+"), study_lock(tmp_path, "s"):
            pass
        with study_lock(tmp_path, "other"):  # another study is another lock
            pass
    code = (
        "import sys, time; sys.path.insert(0, sys.argv[1]); from pathlib import Path; "
        "from flows.sweep.study import study_lock\n"
        "with study_lock(Path(sys.argv[2]), 's'):\n print('held', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(ROOT), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    with pytest.raises(SweepBusy), study_lock(tmp_path, "s"):
        pass
    holder.kill()  # kill -9: the kernel frees the lock
    holder.wait()
    with study_lock(tmp_path, "s"):
        pass


@pytest.mark.fast
def test_a_difference_smaller_than_the_seed_spread_is_within_noise() -> None:
    marks = report.noise_marks({"a": [0.90, 0.92, 0.94], "b": [0.91, 0.90, 0.92], "c": [0.80, 0.81, 0.79]})
    assert marks["a"] == "best" and marks["b"] == "within noise" and marks["c"].startswith("worse by 0.1200")
    assert report.noise_marks({"a": [0.9], "b": [0.8]})["b"].endswith("(one seed: spread unknown)")


@pytest.mark.fast
def test_bad_trials_or_parallel_are_refused_in_one_line() -> None:
    for flag, value in (("--trials", "0"), ("--trials", "three"), ("--parallel", "-2")):
        proc = subprocess.run([sys.executable, "-m", "flows.sweep_flow", flag, value], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        name = flag.removeprefix("--").upper()
        assert (
            proc.returncode == 2
            and proc.stderr == f"error: {name}={value} is not a positive integer: make sweep {name}=3\n"
        )


@pytest.mark.fast
def test_the_parent_run_is_the_studys_own_and_its_best_follows_a_resume(tmp_path: Path) -> None:
    """A resumed study finds its parent again; a study started over after its journal was deleted gets a new
    one (same name, new journal); a resume that finds a better trial moves the parent's best."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sweep = load_params(ROOT / "params.yaml").sweep
    runs = tmp_path / "runs"
    store = Store(uri)
    journal = runs / "sweep" / f"{sweep.study}.journal"
    first = report.parent_run(store, "imagepipe", sweep.study, study_uid(open_study(runs, sweep, 3)), journal)
    again = report.parent_run(store, "imagepipe", sweep.study, study_uid(open_study(runs, sweep, 3)), journal)
    assert first and again == first

    one = TrialResult(number=0, name="t0", values={"train.lr": 0.01}, seed=None, state="complete", val_accuracy=0.8)
    report.close_parent(store, first, one, None, "table")
    two = TrialResult(number=1, name="t1", values={"train.lr": 0.05}, seed=None, state="complete", val_accuracy=0.9)
    report.close_parent(store, first, two, None, "table")  # the resumed sweep's better trial
    parent = tracking.client(uri).get_run(first)
    assert parent.data.tags["sweep.best"] == "t1" and parent.data.tags["best.train.lr"] == "0.05"
    assert parent.data.metrics["best_val_accuracy"] == 0.9

    journal.unlink()
    fresh = report.parent_run(store, "imagepipe", sweep.study, study_uid(open_study(runs, sweep, 3)), journal)
    assert fresh and fresh != first


@pytest.mark.fast
def test_a_trial_that_fails_after_its_gate_logged_it_is_one_failed_child_not_two(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    store = Store(uri)
    client = tracking.client(uri)
    old_parent = report.parent_run(store, "imagepipe", "s", "old-uid", tmp_path / "j")
    parent = report.parent_run(store, "imagepipe", "s", "new-uid", tmp_path / "j")
    exp_id = client.get_experiment_by_name("imagepipe").experiment_id
    for owner in (old_parent, parent):  # the gate's run of trial 0, in an earlier study of that name and in this one
        client.create_run(exp_id, tags={"sweep.trial": "s:0", "mlflow.parentRunId": owner, "sweep.state": "complete"})
    failed = TrialResult(number=0, name="s-t000", values={"train.lr": 0.01}, seed=None, state="failed",
                         message="git fetch of experiment s-t000 failed")  # fmt: skip
    report.log_unfinished(store, "imagepipe", parent, "s", failed)
    runs = client.search_runs([exp_id], filter_string="tags.`sweep.trial` = 's:0'")
    states = {r.data.tags["mlflow.parentRunId"]: (r.data.tags["sweep.state"], r.info.status) for r in runs}
    assert len(runs) == 2 and states[parent] == ("failed", "FAILED")
    assert states[old_parent] == ("complete", "RUNNING")  # another study's run of the same name is untouched


@pytest.mark.fast
def test_seed_reruns_belong_to_their_study_and_a_study_started_over_runs_its_own(tmp_path: Path) -> None:
    """runs/sweep/<study>.seeds.json is the study's (its journal's uid): a resume reruns only what is missing; a
    study started over after its journal was deleted, whose best trial has the old one's name, reruns it."""
    sweep = load_params(ROOT / "params.yaml").sweep.model_copy(update={"study": "s", "seeds": 2, "rerun_top": 1})
    runs, asked = tmp_path / "runs", []

    def submit(name: str, number: int, values: dict[str, Any], seed: int, tag: str) -> TrialResult:
        asked.append((name, seed))
        return TrialResult(number=number, name=name, values=values, seed=seed, state="complete",
                           val_accuracy=0.5 + len(asked) / 10)  # fmt: skip

    def study_with_its_best(value: float) -> tuple[Any, str]:
        study = open_study(runs, sweep, 3)
        study.add_trial(optuna.trial.create_trial(
            params={"train.lr": 0.01}, distributions={"train.lr": FloatDistribution(1e-6, 0.2, log=True)},
            value=value, user_attrs={"name": "s-t000"},
        ))  # fmt: skip
        return study, study_uid(study)

    def rerun(study: Any, uid: str) -> dict[str, list[float]]:
        return rerun_seeds(study, sweep, 42, seeds_path(runs, "s"), uid, submit, logging.getLogger("test"))

    first, uid = study_with_its_best(0.8)
    assert rerun(first, uid) == {"s-t000": [0.6]} and asked == [("s-t000-seed43", 43)]
    assert rerun(first, uid) == {"s-t000": [0.6]} and len(asked) == 1  # a resume: nothing missing, nothing rerun
    (runs / "sweep" / "s.journal").unlink()  # the docs' "start over"
    again, new_uid = study_with_its_best(0.7)
    assert new_uid != uid
    assert rerun(again, new_uid) == {"s-t000": [0.7]} and asked[1:] == [("s-t000-seed43", 43)]


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A committed tiny run on a 3-colour folder that a good learning rate learns within an epoch."""
    root = tmp_path_factory.mktemp("sweep")
    source = make_imagefolder(root / "images", classes=3, per_class=50)
    repo = make_project(root / "repo", {
        "data": {"source": str(source)},
        "train": {"epochs": 3, "batch_size": 8, "lr": 0.05, "warmup_epochs": 0},
        "export": {"formats": ["onnx"]},
        "tracking": {"enabled": True},
        "sweep": {"trials": 2, "pruner": "median", "startup_trials": 1, "warmup_epochs": 0, "seeds": 2,
                  "rerun_top": 1},
    })  # fmt: skip
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["sweep"]["space"] = SPACE  # only the learning rate
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    dvc("repro", cwd=repo)
    commit(repo, "the run record")
    return repo


@pytest.mark.slow  # 2 trials of a tiny pipeline each, about 2 minutes
def test_a_sweep_runs_trials_as_experiments_prunes_and_names_the_best(project: Path, prefect_api: None) -> None:
    from flows.sweep_flow import sweep_flow

    params = load_params(project / "params.yaml")
    study = open_study(project / "runs", params.sweep, 3)
    study.enqueue_trial({"train.lr": 0.08})  # learns the colours in an epoch (0.05 ran: DVC would restore it)
    study.enqueue_trial({"train.lr": 0.000001})  # does not: pruned before its last epoch
    before = (project / "params.yaml").read_text(), sh(["git", "status", "--porcelain"], cwd=project).stdout
    with contextlib.chdir(project):
        result = sweep_flow(trials=2)
    assert result["best"] == "default-t000" and result["values"] == {"train.lr": 0.08}
    trials = {t.number: t for t in open_study(project / "runs", params.sweep, 3).get_trials()}
    assert trials[0].state.name == "COMPLETE" and trials[1].state.name == "PRUNED"
    assert sorted(trials[1].intermediate_values) == [1, 2]  # stopped at the epoch where it was pruned, before 3
    # The workspace never saw a trial: params.yaml, git status, no copy left behind.
    assert ((project / "params.yaml").read_text(), sh(["git", "status", "--porcelain"], cwd=project).stdout) == before
    assert not [p for p in (project / "runs/sweep/default").iterdir() if p.is_dir()]
    # DVC: the finished trial is an experiment of this repository; the pruned one is none.
    shown = dvc("exp", "show", "--json", cwd=project).stdout
    assert "default-t000" in shown and "default-t001" not in shown
    # MLflow: a parent run with both trials as children, the pruned one recorded as pruned.
    client = tracking.client(f"sqlite:///{project / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("imagepipe").experiment_id])
    parent = next(r for r in runs if r.data.tags.get(report.PARENT_TAG) == "default")
    children = {
        r.data.tags.get("sweep.trial"): r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
    }
    assert set(children) == {"default:0", "default:1", "default:0:seed43"}
    assert children["default:1"].data.tags["sweep.state"] == "pruned"
    assert children["default:0"].data.params["train.lr"] == "0.08" and parent.data.tags["sweep.best"] == "default-t000"
    # sweep.seeds 2: the best configuration ran again with seed 43, and the table gives its mean and spread
    rerun = next(r for r in runs if r.data.tags.get("sweep.trial") == "default:0:seed43")
    assert rerun.data.params["seed"] == "43" and rerun.data.params["train.lr"] == "0.08"
    table = client.download_artifacts(parent.info.run_id, "comparison.md")
    assert " ± " in Path(table).read_text() and "(2)" in Path(table).read_text()
    # The best trial applies as any experiment: its params and its model, from the shared cache.
    dvc("exp", "apply", "default-t000", cwd=project)
    assert yaml.safe_load((project / "params.yaml").read_text())["train"]["lr"] == 0.08
    assert dvc("status", cwd=project).returncode == 0


def _sweep(project: Path, study: str, trials: int, parallel: int = 1) -> subprocess.Popen[str]:
    """`make sweep`'s command in its own process (a temporary Prefect server of its own), output line by line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PREFECT_HOME"] = str(project.parent / "prefect-home")  # outside the checkout: its git status is checked
    command = [sys.executable, "-m", "flows.sweep_flow", "--trials", str(trials), "--study", study]
    command += ["--parallel", str(parallel)]
    return subprocess.Popen(command, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(proc: subprocess.Popen[str], words: str, seen: list[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        if words in line:
            return
    raise AssertionError(f"{words!r} never came:\n{''.join(seen[-40:])}")


def _processes_in(folder: Path, name: str) -> list[int]:
    """pids of processes whose command line has `name` and whose working directory is under `folder`."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if (
                name in (proc / "cmdline").read_bytes().decode(errors="replace")
                and folder in (proc / "cwd").resolve().parents
            ):
                found.append(int(proc.name))
    return found


def _status(project: Path) -> str:
    """git status of the workspace, less runs/ (the test project, unlike the project, does not ignore it)."""
    lines = sh(["git", "status", "--porcelain"], cwd=project).stdout.splitlines()
    return "\n".join(line for line in lines if not line[3:].startswith("runs/"))


def _states(project: Path, study: str) -> dict[int, str]:
    params = load_params(project / "params.yaml").sweep.model_copy(update={"study": study})
    return {t.number: t.state.name for t in open_study(project / "runs", params, 3).get_trials()}


@pytest.mark.slow  # about 3 minutes: three trials of a tiny pipeline
def test_kill_9_of_a_trial_fails_it_and_the_sweep_goes_on(project: Path) -> None:
    status = _status(project)
    sweep, seen = _sweep(project, "killed-trial", 2), []
    _wait_for(sweep, "[killed-trial-t000] [train] epoch 1:", seen)
    victims = _processes_in(project / "runs/sweep/killed-trial", "tasks.train")
    assert victims, "no train process of trial 0 found"
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    out, _ = sweep.communicate(timeout=900)
    assert sweep.returncode == 0, "".join(seen) + out
    assert _states(project, "killed-trial") == {0: "FAIL", 1: "COMPLETE", 2: "COMPLETE"}, out
    assert "best trial: killed-trial-t00" in out and "dvc exp apply killed-trial-t00" in out
    assert _status(project) == status
    assert not [p for p in (project / "runs/sweep/killed-trial").iterdir() if p.is_dir()]


@pytest.mark.slow  # about 3 minutes
def test_a_killed_sweep_resumes_with_the_same_command_and_retries_the_running_trial(project: Path) -> None:
    sweep, seen = _sweep(project, "resumed", 1), []
    _wait_for(sweep, "[resumed-t000] [train] epoch 1:", seen)
    values = [line for line in seen if "trial resumed-t000: {" in line][0].split("trial resumed-t000: ", 1)[1].strip()
    sweep.kill()  # kill -9 of the sweep: its trial's processes are orphans, its copy stays behind
    sweep.wait()
    assert _states(project, "resumed") == {0: "RUNNING"}
    again = _sweep(project, "resumed", 1)
    out, _ = again.communicate(timeout=900)
    assert again.returncode == 0, out
    assert "removed 1 trial copies a killed sweep left" in out and "trials [0] were running when it stopped" in out
    assert f"trial resumed-t001: {values}" in out  # the same values, run again
    assert _states(project, "resumed") == {0: "FAIL", 1: "COMPLETE"}
    assert not _processes_in(project / "runs/sweep/resumed", "tasks.")


@pytest.mark.slow  # about 2 minutes: two trials at once, stopped in their first epoch
def test_parallel_trials_get_their_own_cores_and_ctrl_c_stops_them_all(project: Path) -> None:
    """PARALLEL=2: each trial's processes are pinned to their own CPUs (train.threads stays out of the
    experiment); Ctrl-C of the sweep stops both trials at once and removes their copies, and the journal keeps
    them RUNNING, so the same command retries them."""
    status = _status(project)
    sweep, seen = _sweep(project, "interrupted", 2, parallel=2), []
    _wait_for(sweep, "[interrupted-t00", seen)  # a trial's first line
    started = [f"[interrupted-t00{n}] [train] epoch 1:" for n in (0, 1)]
    while not all(any(words in line for line in seen) for words in started):
        _wait_for(sweep, "[train] epoch 1:", seen)
    pids = _processes_in(project / "runs/sweep/interrupted", "tasks.train")
    assert len(pids) >= 2, "".join(seen)
    cpus = {pid: os.sched_getaffinity(pid) for pid in pids}
    mine = os.sched_getaffinity(0)
    if len(mine) >= 2:
        by_trial: dict[Path, set[int]] = {}
        for pid, cores in cpus.items():
            copy = next(p for p in (Path(f"/proc/{pid}/cwd").resolve(), *Path(f"/proc/{pid}/cwd").resolve().parents)
                        if p.parent == project / "runs/sweep/interrupted")  # fmt: skip
            by_trial.setdefault(copy, set()).update(cores)
        first, second = by_trial.values()
        assert first and second and not first & second and first | second <= mine, by_trial
    assert not any("train.threads" in line for line in seen if "dvc exp run" in line or "exp run -n" in line)

    sweep.send_signal(signal.SIGINT)
    out, _ = sweep.communicate(timeout=120)
    assert sweep.returncode != 0
    assert "stopped 2 running trials; the same command retries them" in "".join(seen) + out
    assert not _processes_in(project / "runs/sweep/interrupted", "tasks.")
    assert not _processes_in(project / "runs/sweep/interrupted", "dvc")
    assert not [p for p in (project / "runs/sweep/interrupted").iterdir() if p.is_dir()]
    assert _states(project, "interrupted") == {0: "RUNNING", 1: "RUNNING"}
    assert _status(project) == status
