"""The DAG of dvc.yaml, as DVC itself resolves it: stages, their deps/outs, and which stages feed which.

`dvc.repo.Repo(...).index` interpolates `${...}` from params.yaml, expands `foreach`/`matrix` and
`vars`, and builds the stage graph from overlapping outs and deps, exactly as `dvc repro` will run
it. Prefect flows take their tasks from here, so there is one declaration of the pipeline, not two.
"""

from __future__ import annotations

import graphlib
from dataclasses import dataclass
from pathlib import Path

from dvc.repo import Repo
from dvc.stage import PipelineStage


@dataclass(frozen=True)
class Stage:
    name: str
    cmd: str
    deps: tuple[str, ...]
    outs: tuple[str, ...]  # outs, metrics and plots alike, as paths relative to the repository
    uncached: tuple[str, ...]  # the outs with `cache: false`: git carries them, never a DVC remote
    upstream: frozenset[str]  # the stages whose outputs this one depends on


def load_stages(repo_dir: Path = Path(".")) -> dict[str, Stage]:
    """The stages of `repo_dir`'s dvc.yaml, in an order where every stage follows its upstream ones."""
    with Repo(str(repo_dir)) as repo:
        graph = repo.index.graph  # an edge goes from a stage to a stage it depends on
        stages = {}
        # dvc.yaml's stages only: a `dvc add`ed folder or file (data/raw/*.dvc, baseline/*.dvc) is a node too
        for stage in (node for node in graph.nodes if isinstance(node, PipelineStage)):
            cmd = stage.cmd if isinstance(stage.cmd, str) else " && ".join(stage.cmd)
            stages[stage.name] = Stage(
                name=stage.name,
                cmd=cmd,
                deps=tuple(str(dep.def_path) for dep in stage.deps),
                outs=tuple(str(out.def_path) for out in stage.outs),
                uncached=tuple(str(out.def_path) for out in stage.outs if not out.use_cache),
                upstream=frozenset(up.name for up in graph.successors(stage) if isinstance(up, PipelineStage)),
            )
    return {name: stages[name] for layer in layers(stages) for name in layer}


def upstream(stages: dict[str, Stage]) -> dict[str, set[str]]:
    """For each stage, the stages whose outputs it depends on."""
    return {name: set(stage.upstream) for name, stage in stages.items()}


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
