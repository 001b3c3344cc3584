"""The DAG of dvc.yaml, read from dvc.yaml itself: stages, their resolved deps/outs, and run order.

Prefect flows take their tasks from here, so there is one declaration of the pipeline, not two.
"""

from __future__ import annotations

import graphlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

_TEMPLATE = re.compile(r"\$\{\s*([\w.]+)\s*\}")


@dataclass(frozen=True)
class Stage:
    name: str
    cmd: str
    deps: tuple[str, ...]
    outs: tuple[str, ...]
    params: tuple[str, ...]


def _resolve(text: str, params: dict[str, Any]) -> str:
    def value(match: re.Match[str]) -> str:
        node: Any = params
        for part in match.group(1).split("."):
            if not isinstance(node, dict) or part not in node:
                raise KeyError(f"dvc.yaml: ${{{match.group(1)}}} is not a key of params.yaml")
            node = node[part]
        return str(node)

    return _TEMPLATE.sub(value, text)


def _paths(entries: list[Any] | None) -> list[str]:
    """Path strings from a DVC list whose items are `path` or `{path: {options}}`."""
    out = []
    for entry in entries or []:
        out.extend(entry.keys() if isinstance(entry, dict) else [entry])
    return out


def load_stages(repo_dir: Path = Path(".")) -> dict[str, Stage]:
    pipeline = yaml.safe_load((repo_dir / "dvc.yaml").read_text())
    params = yaml.safe_load((repo_dir / "params.yaml").read_text())
    stages = {}
    for name, body in pipeline["stages"].items():
        outs = [*_paths(body.get("outs")), *_paths(body.get("metrics")), *_paths(body.get("plots"))]
        stages[name] = Stage(
            name=name,
            cmd=body["cmd"],
            deps=tuple(_resolve(d, params) for d in _paths(body.get("deps"))),
            outs=tuple(_resolve(o, params) for o in outs),
            params=tuple(_paths(body.get("params"))),
        )
    return stages


def _is_under(path: str, root: str) -> bool:
    p, r = Path(path), Path(root)
    return p == r or r in p.parents


def upstream(stages: dict[str, Stage]) -> dict[str, set[str]]:
    """For each stage, the stages whose outputs it depends on."""
    return {
        name: {
            other.name
            for other in stages.values()
            if other.name != name and any(_is_under(dep, out) for dep in stage.deps for out in other.outs)
        }
        for name, stage in stages.items()
    }


def layers(stages: dict[str, Stage]) -> list[list[str]]:
    """Stages grouped into layers; the stages of one layer don't depend on each other."""
    sorter = graphlib.TopologicalSorter(upstream(stages))
    sorter.prepare()
    order = []
    while sorter.is_active():
        ready = sorted(sorter.get_ready())
        order.append(ready)
        sorter.done(*ready)
    return order
