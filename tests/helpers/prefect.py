"""Reading a Prefect run back through the real API (task runs, logs, artifacts), and a model made worse on purpose."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from typing import Any
from uuid import UUID

import numpy as np
import onnx

# The crash test's planted worse model is judged by its loss: a tiny model is near chance, so only
# a loss rule tells a planted bad model from it reliably.
LOSS_RULE = {"metric": "loss", "direction": "lower", "abs_tol": 0.05}


RULES = [{"metric": "accuracy", "direction": "higher", "abs_tol": 0.02}, LOSS_RULE]


def worsen_onnx(path: Path) -> None:
    """A worse model with the same file layout: the classifier's logits negated and scaled up."""
    model = onnx.load(str(path))
    gemm = [node for node in model.graph.node if node.op_type == "Gemm"][-1]
    for tensor in model.graph.initializer:
        if tensor.name in gemm.input[1:]:
            values = onnx.numpy_helper.to_array(tensor) * np.float32(-20.0)
            tensor.CopyFrom(onnx.numpy_helper.from_array(values, tensor.name))
    onnx.save(model, str(path))


def api_task_runs(flow_run_id: UUID) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


def api_logs(flow_run_id: UUID, wait_for: str | None = None, timeout: float = 20.0) -> str:
    """All log lines of a flow run; logs are shipped in batches, so wait until `wait_for` has arrived."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + timeout
    while True:
        lines: list[str] = []
        with get_client(sync_client=True) as client:
            while batch := client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200, offset=len(lines)
            ):
                lines.extend(log.message for log in batch)
        text = "\n".join(lines)
        if wait_for is None or wait_for in text or time.monotonic() > deadline:
            return text
        time.sleep(1)


def api_artifacts(flow_run_id: UUID) -> dict[str, Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    of_run = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=of_run)
    return {artifact.key: artifact for artifact in found}


VENV = Path(sys.executable).parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prefect_env(home: Path, port: int, **extra: str) -> dict[str, str]:
    """The test's own server settings, whatever the calling shell has set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(IMAGEPIPE_VENV=str(VENV), PREFECT_HOME=str(home), PREFECT_SERVER_API_PORT=str(port), **extra)
    return env
