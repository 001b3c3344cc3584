"""The experiment table: one MLflow run per record, keyed by the record's outputs; a broken store never fails
a run; the registry's `production` alias follows make promote. Real MLflow on a real SQLite file."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

from tasks.core.params import load_params
from tasks.release import tracking
from tasks.release.run_record import record_key
from tests.helpers.prefect import free_port
from tests.helpers.tracking import finished_project as _project

pytestmark = pytest.mark.fast


def _runs(uri: str) -> list:
    client = tracking.client(uri)
    experiment = client.get_experiment_by_name("imagepipe")
    return [] if experiment is None else client.search_runs([experiment.experiment_id])


def test_a_record_is_one_run_logged_once_and_a_changed_record_is_another(tmp_path: Path, monkeypatch) -> None:
    root = _project(tmp_path / "proj")
    monkeypatch.chdir(root)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    params = load_params(root / "params.yaml")
    first = tracking.mirror(params, root)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    runs = _runs(uri)
    assert first and [r.info.run_id for r in runs] == [first]
    run = runs[0]
    assert run.data.metrics["test_accuracy"] == 0.9 and run.data.metrics["int8_accuracy_drop"] == 0.01
    assert run.data.metrics["latency_ms_batch1.onnx_int8"] == 1.5 and run.data.metrics["f1.a"] == 0.8
    assert run.data.params["train.lr"] == "auto" and run.data.params["seed"] == "42"
    assert run.data.tags["env.precision"] == "bf16" and run.data.tags["gate.verdict"] == "pass"
    history = tracking.client(uri).get_metric_history(first, "val_accuracy")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.7)]
    artifacts = {a.path for a in tracking.client(uri).list_artifacts(first, "reports")}
    assert artifacts == {"reports/regression.md"}  # the PNGs this fake run lacks are skipped
    assert (root / "mlartifacts").is_dir()  # beside the store, not wherever the run's working directory was

    assert tracking.mirror(params, root) == first  # a no-op rerun: the same outputs, the same run
    (root / "runs" / "tracking" / "logged.json").unlink()  # without the local note, the store's key finds it
    assert tracking.mirror(params, root) == first and len(_runs(uri)) == 1
    gate = root / "reports" / "gate.json"  # `dvc repro` enforcing the verdict `dvc exp run` recorded: the same run
    gate.write_text(json.dumps({**json.loads(gate.read_text()), "enforced": False}))
    assert tracking.mirror(params, root) == first and len(_runs(uri)) == 1

    _project(root, accuracy=0.95)  # a rerun that changed something
    second = tracking.mirror(params, root)
    assert second != first and len(_runs(uri)) == 2


def test_tracking_off_logs_nothing_and_says_so(tmp_path: Path, monkeypatch, caplog) -> None:
    root = _project(tmp_path / "proj")
    text = (root / "params.yaml").read_text()
    assert "  enabled: true" in text
    (root / "params.yaml").write_text(text.replace("  enabled: true", "  enabled: false", 1))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    params = load_params(root / "params.yaml")
    assert params.tracking.enabled is False
    with caplog.at_level(logging.INFO, logger="tasks.release.tracking"):
        assert tracking.mirror(params, root) is None
        assert tracking.nightly(params, root, {"accuracy": 0.9}, "pass", True, "sha") is None
        assert tracking.register_production(params, root / "reports" / "regression.md", "sha", root=root) is None
    assert not (root / "mlflow.db").exists() and not (root / "mlartifacts").exists()
    said = [r.getMessage() for r in caplog.records if r.name == "tasks.release.tracking"]
    assert said and all(m == "MLflow: not logged (tracking.enabled is false in params.yaml)" for m in said), said


def test_mlflow_tracking_uri_takes_precedence(tmp_path: Path, monkeypatch) -> None:
    root = _project(tmp_path / "proj")
    elsewhere = tmp_path / "shared" / "store.db"
    elsewhere.parent.mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{elsewhere}")
    assert tracking.mirror(load_params(root / "params.yaml"), root)
    assert elsewhere.is_file() and not (root / "mlflow.db").exists()


def test_a_relative_tracking_uri_is_the_projects_even_from_a_dvc_temp_copy(tmp_path: Path, monkeypatch) -> None:
    """`dvc exp run --temp` and sweep trials run in a copy under the project: a relative store must not follow
    them there (it would be deleted with the copy)."""
    root = _project(tmp_path / "proj")
    copy = root / ".dvc" / "tmp" / "exps" / "tmpabc123"
    _project(copy)
    monkeypatch.chdir(copy)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///store.db")
    uri = tracking.tracking_uri(tracking.project_root(copy))
    name = "store.db"
    assert uri.endswith(str(root.resolve() / name)) and str(copy) not in uri
    assert tracking.mirror(load_params(copy / "params.yaml"), copy)
    assert (root / name).exists() and not (copy / name).exists()


@pytest.mark.parametrize("store", ["unreachable server", "not a database"])
def test_a_broken_store_costs_one_warning_never_the_run(tmp_path: Path, monkeypatch, caplog, store: str) -> None:
    root = _project(tmp_path / "proj")
    if store == "unreachable server":
        uri = f"http://127.0.0.1:{free_port()}"
    else:
        garbage = tmp_path / "broken.db"
        garbage.write_bytes(b"this is not SQLite" * 100)
        uri = f"sqlite:///{garbage}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="tasks.release.tracking"):
        assert tracking.mirror(load_params(root / "params.yaml"), root) is None
    warnings = [
        r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "tasks.release.tracking"
    ]
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: MLflow store {uri} not written"), warnings
    assert "record (dvc.lock, reports/) is complete" in warnings[0]
    assert time.monotonic() - started < 60  # no minutes of retries


def test_promote_registers_the_onnx_with_the_production_alias(tmp_path: Path, monkeypatch) -> None:
    root = _project(tmp_path / "proj")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    params = load_params(root / "params.yaml")
    onnx = root / "baseline" / "model.onnx"
    onnx.parent.mkdir()
    onnx.write_bytes(b"onnx one")
    assert tracking.register_production(params, onnx, "sha-one", root=root) == "1"
    assert tracking.register_production(params, onnx, "sha-one", root=root) == "1"  # the same model: the same version
    onnx.write_bytes(b"onnx two")
    _project(root, accuracy=0.95)
    decision = {"decision.reason": "a tenth class joined", "decision.set_aside": "different test set: ..."}
    assert tracking.register_production(params, onnx, "sha-two", decision, root=root) == "2"
    client = tracking.client(f"sqlite:///{root / 'mlflow.db'}")
    version = client.get_model_version_by_alias("imagepipe", "production")
    assert str(version.version) == "2" and version.tags["onnx_sha256"] == "sha-two"
    assert version.tags["decision.reason"] == "a tenth class joined"  # the accepted decision, on the version
    assert tracking.register_production(params, onnx, "sha-two", {"decision.gate": "pass"}, root=root) == "2"
    tags = client.get_model_version("imagepipe", "2").tags  # promoted again, no reason needed: the old one goes
    assert tags["decision.gate"] == "pass" and "decision.reason" not in tags and "decision.set_aside" not in tags
    assert version.source.endswith("/model/model.onnx") and version.run_id == _runs(client.tracking_uri)[0].info.run_id


def test_a_dvc_temp_experiment_logs_to_the_project_beside_it() -> None:
    assert tracking.project_root(Path("/work/proj/.dvc/tmp/exps/tmpab12cd")) == Path("/work/proj")
    assert tracking.project_root(Path("/work/proj/.dvc/tmp/exps/tmpab12cd/sub")) == Path("/work/proj")
    assert tracking.project_root(Path("/work/proj")) == Path("/work/proj")


def test_the_record_key_is_the_model_and_its_scores_not_how_the_gate_was_enforced() -> None:
    """The same model and scores re-gated (an experiment's recorded verdict, then `dvc repro` enforcing it; the
    scores reused or made again under new code) are one record; a changed score is another."""
    scores = {"accuracy": 0.9, "test_set_sha256": "t" * 64}
    reports = {
        "train_run": {"run": "r1"},
        "metrics": {"accuracy": 0.9},
        "export": {"agreement": 1.0},
        "regression": {"verdict": "pass", "metrics": scores, "model": {"onnx_sha256": "m" * 64},
                       "scored": {"key": "k1"}, "baseline_rescored": {"metrics": scores, "scored": {"key": "k2"}}},
        "gate": {"verdict": "pass", "passed": True, "enforced": False},
    }  # fmt: skip
    regated = {
        **reports,
        "regression": {**reports["regression"], "scored": {"key": "k3"},
                       "baseline_rescored": {"metrics": scores, "scored": {"key": "k4"}}},
        "gate": {**reports["gate"], "enforced": True},
    }  # fmt: skip
    assert record_key(regated) == record_key(reports)
    assert reports["gate"]["enforced"] is False and reports["regression"]["scored"] == {"key": "k1"}  # not changed
    rescored = {**reports, "regression": {**reports["regression"], "metrics": {**scores, "accuracy": 0.91}}}
    assert record_key(rescored) != record_key(reports)
    assert record_key({**reports, "gate": {**reports["gate"], "passed": False}}) != record_key(reports)


def test_the_test_set_tag_is_the_set_that_was_scored(tmp_path: Path) -> None:
    """MLflow's data.test_sha256 names the images the verdict scored: regression.json's test_set_sha256 for a gate,
    the promoted set's for a nightly (not today's whole test split, which grows after `make add-data INTO=`)."""
    from tasks.images.image_set import image_set_sha256
    from tasks.release.run_record import gather, nightly_record

    root = _project(tmp_path / "proj")
    params = load_params(root / "params.yaml")
    shards = root / params.paths.shards
    shards.mkdir(parents=True)
    today = [{"sha256": c * 64, "split": "test", "label": 0} for c in "abc"]  # today's split: three images
    (shards / "manifest.json").write_text(json.dumps({"files": today, "class_names": ["a"]}))
    promoted = image_set_sha256(["a" * 64, "b" * 64])
    regression = root / params.paths.regression_json
    regression.write_text(json.dumps({"verdict": "pass", "test_set_sha256": promoted}))
    assert gather(params, root).tags["data.test_sha256"] == promoted
    night = nightly_record(params, root, {"accuracy": 0.9, "test_set_sha256": promoted}, "pass", True, "f" * 64)
    assert night.tags["data.test_sha256"] == promoted


def test_a_gate_waits_while_another_writer_holds_the_store(tmp_path: Path, monkeypatch) -> None:
    """Every writer of a SQLite store (the gate here; promote, the nightly and a sweep's copies too) takes the
    store's one writer lock, so a sweep writing the project's store and a `make run` never write it at once."""
    import threading

    from tasks.release.mlflow_store import writing

    root = _project(tmp_path / "proj")
    monkeypatch.chdir(root)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    params = load_params(root / "params.yaml")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    assert tracking.mirror(params, root)  # the store exists: what is left to time is the write itself
    _project(root, accuracy=0.95)
    finished: list[float] = []
    held = 5.0
    with writing(uri):
        started = time.monotonic()
        thread = threading.Thread(target=lambda: (tracking.mirror(params, root), finished.append(time.monotonic())))
        thread.start()
        time.sleep(held)
    thread.join(120)
    assert finished and finished[0] - started >= held, "the gate wrote while another writer held the store"
    assert len(_runs(uri)) == 2
