"""A flow run cannot change what a worker runs: the work pools' base job template (flows/process_pool_template.json)
exposes no `command`, `env` or `working_dir`, so the Prefect server refuses a flow run that overrides them
(prefect/server/api/validation.py validates a flow run's job variables against the pool's `variables` schema,
whose additionalProperties is false); and the flows refuse to start when their environment carries a variable
that changes the gate, the hooks or the checkout (flows/shell.py OVERRIDING_ENV). Real Prefect servers."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flows.shell import OVERRIDING_ENV, OverriddenEnvironment, refuse_overriding_env
from tests.helpers.prefect import Production, free_port, production_project
from tests.helpers.project import ROOT, make_project

TEMPLATE = json.loads((ROOT / "flows" / "process_pool_template.json").read_text())
OVERRIDES = [{"env": {"DVC_EXP_NAME": "x"}}, {"env": {"IMAGEPIPE_CHECKOUT": "/tmp"}},
             {"command": "touch /tmp/owned"}, {"working_dir": "/tmp"}, {"env.DVC_EXP_NAME": "x"}]  # fmt: skip


@pytest.mark.fast
def test_the_flows_refuse_an_environment_that_changes_the_gate_hooks_or_checkout(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in OVERRIDING_ENV:
        monkeypatch.delenv(name, raising=False)
    refuse_overriding_env("train-flow")
    monkeypatch.setenv("DVC_EXP_NAME", "exp-1")
    with pytest.raises(OverriddenEnvironment, match=r"^train-flow refuses to run with DVC_EXP_NAME \(changes the "
                                                    r"regression gate .*recorded, not enforced\)"):  # fmt: skip
        refuse_overriding_env("train-flow")
    monkeypatch.delenv("DVC_EXP_NAME")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("IMAGEPIPE_CHECKOUT", str(tmp_path))  # the worker's own setting: where the flow runs
    refuse_overriding_env("run-stage")
    monkeypatch.setenv("IMAGEPIPE_CHECKOUT", str(tmp_path / "elsewhere"))
    with pytest.raises(OverriddenEnvironment, match=r"IMAGEPIPE_CHECKOUT \(changes the checkout a stage runs in\)"):
        refuse_overriding_env("regression-flow")
    monkeypatch.delenv("IMAGEPIPE_CHECKOUT")
    monkeypatch.setenv("IMAGEPIPE_TRAIN_HOOKS", "/x/hooks.py")
    with pytest.raises(OverriddenEnvironment, match=r"IMAGEPIPE_TRAIN_HOOKS \(changes the training hooks"):
        refuse_overriding_env("train-flow")


def test_train_flow_fails_before_any_stage_with_dvc_exp_name_set(
    prefect_api: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.train_flow import train_flow

    repo = make_project(tmp_path / "repo")
    monkeypatch.setenv("DVC_EXP_NAME", "exp-1")
    with contextlib.chdir(repo):
        state = train_flow(push=False, return_state=True)
    assert state.is_failed() and "refuses to run with DVC_EXP_NAME" in str(state.message)
    assert not (repo / "dvc.lock").exists()  # nothing ran


def test_the_server_refuses_a_flow_run_that_overrides_command_env_or_working_dir(prefect_api: None) -> None:
    """The pool as `make prefect-pool` creates it, a deployment on it, and flow runs created through the API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import PrefectHTTPStatusError

    from flows.regression_flow import regression_flow

    with get_client(sync_client=True) as client:
        pool = f"locked-{free_port()}"
        client.create_work_pool(WorkPoolCreate(name=pool, type="process", base_job_template=TEMPLATE))
        flow_id = client.create_flow(regression_flow)
        deployment = client.create_deployment(flow_id=flow_id, name="nightly", work_pool_name=pool,
                                              entrypoint="flows/regression_flow.py:regression_flow")  # fmt: skip
        for override in OVERRIDES:
            with pytest.raises(PrefectHTTPStatusError, match=r"422"):
                client.create_flow_run_from_deployment(deployment, job_variables=override)
        run = client.create_flow_run_from_deployment(deployment, job_variables={"labels": {"team": "ml"}})
        assert run.job_variables == {"labels": {"team": "ml"}}
        with pytest.raises(PrefectHTTPStatusError, match=r"422"):  # nor by updating the run afterwards
            client.update_flow_run(run.id, job_variables={"env": {"DVC_EXP_NAME": "x"}})


@pytest.fixture
def production(tmp_path: Path) -> Iterator[Production]:
    with production_project(tmp_path) as prod:
        yield prod


def _pool(production: Production, name: str) -> Any:
    from prefect.client.orchestration import get_client

    with production.client(), get_client(sync_client=True) as client:
        return client.read_work_pool(name)


@pytest.mark.slow  # about 90 s: a server, a worker and a whole tiny train-flow/prod run
def test_with_a_real_worker_an_override_is_refused_and_a_normal_run_completes(production: Production) -> None:
    assert _pool(production, "local-process").base_job_template == TEMPLATE
    marker = production.repo / "owned"
    refused = production.prefect("deployment", "run", "train-flow/prod", "--job-variable",
                                 f'command="touch {marker}"')  # fmt: skip
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "Additional properties are not allowed ('command' was unexpected)" in " ".join(
        said.split()
    ), said
    refused = production.prefect("deployment", "run", "train-flow/prod", "--job-variable",
                                 'env={"DVC_EXP_NAME": "x"}')  # fmt: skip
    assert refused.returncode != 0 and "('env' was unexpected)" in " ".join((refused.stdout + refused.stderr).split())
    proc, run = production.run_and_watch("train-flow/prod")
    assert proc.returncode == 0 and run.state.is_completed(), run.state.message or proc.stdout[-3000:]
    assert json.loads((production.repo / "reports/gate.json").read_text())["enforced"] is True
    assert not marker.exists()
    # A pool made earlier with Prefect's default template is locked by `make prefect-pool` too.
    default = production.repo.parent / "default-template.json"
    production.prefect("work-pool", "get-default-base-job-template", "--type", "process", "--file", str(default))
    production.prefect("work-pool", "update", "local-process", "--base-job-template", str(default))
    assert "command" in _pool(production, "local-process").base_job_template["variables"]["properties"]
    production.script("pool")
    assert _pool(production, "local-process").base_job_template == TEMPLATE


@pytest.mark.slow  # about 60 s: a server, the project's pools and deployments, a worker
def test_an_api_client_can_create_a_deployment_whose_pull_steps_run_a_command_on_the_worker(
    production: Production,
) -> None:
    """The boundary docs/trust.md states: the base job template stops a flow run from changing the command,
    but whoever can use the API can create a deployment on the project's pool, and its pull steps run in the
    flow run's process on the worker before any flow code loads (prefect/flows.py load_flow_from_flow_run ->
    run_steps). The project's flows cannot refuse it, because they never start. This test holds that statement
    true: if Prefect or the template ever closes the door, it fails and trust.md must be rewritten."""
    from prefect.client.orchestration import get_client

    from flows.regression_flow import regression_flow

    marker = production.repo.parent / "ran-on-the-worker"
    with production.client(), get_client(sync_client=True) as client:
        flow_id = client.create_flow(regression_flow)
        deployment = client.create_deployment(
            flow_id=flow_id, name="not-the-projects", work_pool_name="local-process",
            entrypoint="flows/regression_flow.py:regression_flow",
            pull_steps=[{"prefect.deployments.steps.run_shell_script": {"script": f"touch {marker}"}}],
        )  # fmt: skip
        run = client.create_flow_run_from_deployment(deployment)
        deadline = time.time() + 180
        while not client.read_flow_run(run.id).state.is_final() and time.time() < deadline:
            time.sleep(2)
        final = client.read_flow_run(run.id).state
    assert final.is_final(), final
    assert marker.exists(), f"the pull step did not run on the worker; the run ended {final.name}: {final.message}"
