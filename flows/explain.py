"""A run that explains itself: why DVC runs each stage, and how this run compares with the last one.

- `why_stage_runs(repo, stage)`: DVC's own `dvc status <stage> --json`, asked just before the stage runs
  (after its upstream stages, whose new outputs are among its reasons), in words: "param train.lr: 0.01
  -> 0.02", "dep data/shards modified", "out models/model.pt deleted". A params dep that DVC reports
  as changed is spelled out leaf by leaf from the values dvc.lock recorded for it. [] means DVC skips
  the stage.
- `comparison_markdown(...)`: this run's metrics, params and data hash against the previous completed run
  of the same deployment (read back from its run-manifest artifact through the Prefect API) and against
  the promoted baseline, with deltas, and links to the run's PNGs by their paths.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from tasks.core.nested import flatten
from tasks.core.private_api import dvc_stage_status

STAGE_WORDS = {
    "always changed": "always changed (always_changed: true)",
    "changed checksum": "its definition in dvc.yaml changed",
    "changed command": "its command changed",
}
COMPARED = ("accuracy", "macro_f1", "loss", "num_samples")
MAX_PARAM_LINES = 30


def changed_leaves(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """ "name: old -> new" for every leaf that differs (added: "(none) -> v", removed: "v -> (none)")."""
    lines = []
    for name in sorted(set(old) | set(new)):
        before, after = old.get(name, "(none)"), new.get(name, "(none)")
        if before != after:
            lines.append(f"{name}: {json.dumps(before) if before != '(none)' else before} -> "
                         f"{json.dumps(after) if after != '(none)' else after}")  # fmt: skip
    return lines


def _recorded_params(repo: Path, stage: str, file: str) -> dict[str, Any]:
    lock = repo / "dvc.lock"
    if not lock.is_file():
        return {}
    recorded = (yaml.safe_load(lock.read_text()) or {}).get("stages", {}).get(stage, {})
    return recorded.get("params", {}).get(file, {}) or {}


def _param_reasons(repo: Path, stage: str, file: str, changes: Mapping[str, str]) -> list[str]:
    current = yaml.safe_load((repo / file).read_text()) if (repo / file).is_file() else {}
    recorded = _recorded_params(repo, stage, file)
    reasons = []
    for name, status in changes.items():
        value: Any = current
        for part in name.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        detail = changed_leaves(flatten(recorded.get(name), name), flatten(value, name)) if name in recorded else []
        reasons += [f"param {line}" for line in detail] or [f"param {name} {status}"]
    return reasons


def why_stage_runs(repo: Path, stage: str) -> list[str]:
    """Why DVC will run `stage` now, from its own status; [] when it will skip it."""
    reasons: list[str] = []
    for entry in dvc_stage_status(repo, stage):
        if isinstance(entry, str):
            reasons.append(STAGE_WORDS.get(entry, entry))
            continue
        for kind, changes in entry.items():
            side = {"changed deps": "dep", "changed outs": "out"}.get(kind, kind)
            for path, status in changes.items():
                if isinstance(status, Mapping):  # a params file: {param: status}
                    reasons += _param_reasons(repo, stage, path, status)
                else:
                    reasons.append(f"{side} {path} {status}")
    return reasons


def why_markdown(stages: Mapping[str, str], why: Mapping[str, list[str]]) -> str:
    lines = ["# Why each stage ran", "", "DVC's own status, asked just before each stage.", "",
             "| stage | outcome | why |", "|---|---|---|"]  # fmt: skip
    for name, outcome in stages.items():
        if name in why:
            reasons = "<br>".join(why[name]) or "nothing changed: DVC skips it"
            lines.append(f"| {name} | {outcome} | {reasons} |")
    return "\n".join([*lines, ""])


def _delta(now: Any, then: Any) -> str:
    if isinstance(now, int | float) and isinstance(then, int | float) and not isinstance(now, bool):
        return f"{now - then:+.4f}" if isinstance(now, float) or isinstance(then, float) else f"{now - then:+d}"
    return ""


def _value(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else ("-" if value is None else str(value))


def comparison_markdown(
    current: Mapping[str, Any], previous: Mapping[str, Any] | None, previous_name: str | None,
    baseline: Mapping[str, Any] | None, pictures: Mapping[str, Path],
) -> str:  # fmt: skip
    """`current`/`previous`: run manifests (metrics, params, data_manifest_sha256); `baseline`: baseline metrics."""
    now = current.get("metrics") or {}
    then = (previous or {}).get("metrics") or {}
    base = baseline or {}
    title = f"previous completed run ({previous_name})" if previous is not None else "previous completed run"
    lines = ["# This run against the previous completed run and the baseline", ""]
    if previous is None:
        lines += ["No earlier completed run of this deployment to compare with.", ""]
    if baseline is None:
        lines += ["No promoted baseline (`make promote`).", ""]
    lines += [f"| metric | this run | {title} | delta | baseline | delta |", "|---|---|---|---|---|---|"]
    for name in COMPARED:
        value = now.get(name)
        lines.append(f"| {name} | {_value(value)} | {_value(then.get(name))} | {_delta(value, then.get(name))} | "
                     f"{_value(base.get(name))} | {_delta(value, base.get(name))} |")  # fmt: skip
    if previous is not None:
        changed = changed_leaves(flatten(previous.get("params") or {}, ""), flatten(current.get("params") or {}, ""))
        lines += ["", f"**Params changed since the previous run:** {len(changed) or 'none'}", ""]
        lines += [f"- `{line}`" for line in changed[:MAX_PARAM_LINES]]
        old_data, new_data = previous.get("data_manifest_sha256"), current.get("data_manifest_sha256")
        data = "unchanged" if old_data == new_data else f"changed: {str(old_data)[:12]} -> {str(new_data)[:12]}"
        lines += ["", f"**Data (shard manifest sha256):** {data}"]
    lines += ["", "**Pictures of this run:**", ""]
    lines += [f"- [{name}]({path.as_uri()})" + ("" if path.is_file() else " (not written)")
              for name, path in pictures.items()]  # fmt: skip
    return "\n".join([*lines, ""])


def manifest_from_table(rows: list[Mapping[str, Any]]) -> dict[str, Any]:
    """A run manifest read back from its (flattened) table artifact: the parts a comparison needs."""
    flat = {row["key"]: row["value"] for row in rows}
    out: dict[str, Any] = {"metrics": {}, "params": {}, "data_manifest_sha256": flat.get("data_manifest_sha256")}
    for key, value in flat.items():
        for part in ("metrics", "params"):
            if key.startswith(part + "."):
                target = out[part]
                *parents, leaf = key[len(part) + 1 :].split(".")
                for parent in parents:
                    target = target.setdefault(parent, {})
                target[leaf] = _decoded(value)
    return out


def _decoded(value: Any) -> Any:
    if isinstance(value, str) and value[:1] in "[{":
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def previous_completed_run(
    flow_run_id: str, deployment_id: str | None, manifest_key: str
) -> tuple[dict[str, Any] | None, str | None]:
    """The run manifest of the latest completed run of the same deployment (of the same flow when run
    without one) before this one, read back from its artifact; (None, None) when there is none."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas import filters as f
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    deployment = (
        f.FlowRunFilterDeploymentId(any_=[deployment_id])
        if deployment_id
        else f.FlowRunFilterDeploymentId(is_null_=True)
    )
    runs_filter = f.FlowRunFilter(
        id=f.FlowRunFilterId(not_any_=[flow_run_id]), deployment_id=deployment,
        state=f.FlowRunFilterState(type=f.FlowRunFilterStateType(any_=[StateType.COMPLETED])),
    )  # fmt: skip
    flows = f.FlowFilter(name=f.FlowFilterName(any_=["train-flow"]))
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=flows, flow_run_filter=runs_filter, sort=FlowRunSort.START_TIME_DESC,
                                     limit=10)  # fmt: skip
        for run in runs:
            of_run = f.ArtifactFilter(key=f.ArtifactFilterKey(any_=[manifest_key]),
                                      flow_run_id=f.ArtifactFilterFlowRunId(any_=[run.id]))  # fmt: skip
            found = client.read_artifacts(artifact_filter=of_run)
            if found:
                data = found[0].data
                rows = json.loads(data) if isinstance(data, str) else data
                return manifest_from_table(rows), f"{run.name}, {run.start_time:%Y-%m-%d %H:%M} UTC"
    return None, None
