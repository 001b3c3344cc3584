"""The DAG of dvc.yaml, as DVC itself resolves it: each stage's deps and outs, and which stages feed which.

The one reader of DVC's stages. `dvc.repo.Repo(...).index` interpolates `${...}` from params.yaml, expands
`foreach`/`matrix` and `vars`, and builds the stage graph from overlapping outs and deps, exactly as
`dvc repro` will run it. Prefect flows take their tasks from here, the stages check the code they loaded
against their deps (tasks/core/provenance.py) and `make commit-run` the files a commit must hold
(tasks/tools/commit_run.py): one declaration of the pipeline, read one way.

DVC takes about a second to load, and each stage asks before and after its work, so the answer is kept in
.dvc/tmp under the sha256 of what DVC resolves it from: dvc.yaml, params.yaml, the files its `vars:` name, and
DVC's version.
"""

from __future__ import annotations

import contextlib
import dataclasses
import graphlib
import hashlib
import json
import os
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import yaml

PARAMS_DEP = "params.yaml"  # a stage's `params:` are a dep on this file (DVC hashes the keys it names)


class DagError(ValueError):
    """dvc.yaml cannot be resolved: DVC's own reason, with the file."""


@dataclass(frozen=True)
class Stage:
    name: str
    cmd: str
    deps: tuple[str, ...]  # files and folders, as paths relative to the repository; params.yaml if it has params
    outs: tuple[str, ...]  # outs, metrics and plots alike
    uncached: tuple[str, ...]  # the outs with `cache: false`: git carries them, never a DVC remote
    upstream: frozenset[str]  # the stages whose outputs this one depends on
    always_changed: bool = False  # `always_changed: true`: it runs at every `dvc repro`

    @property
    def path_deps(self) -> tuple[str, ...]:
        """The deps that are files or folders of their own (not the params file its `params:` read)."""
        return tuple(d for d in self.deps if d != PARAMS_DEP)


def _resolution_inputs(root: Path) -> list[bytes]:
    """The bytes DVC resolves dvc.yaml from: itself, params.yaml, each file of its `vars:` (`file` or
    `file:keys`), and DVC's version."""
    names = ["dvc.yaml", PARAMS_DEP]
    with contextlib.suppress(OSError, yaml.YAMLError, AttributeError):
        spec = yaml.load((root / "dvc.yaml").read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        names += [str(v).split(":")[0] for v in (spec.get("vars") or []) if isinstance(v, str)]
    texts = [(root / name).read_bytes() if (root / name).is_file() else b"" for name in names]
    return [*texts, version("dvc").encode()]


def _from_dvc(root: Path) -> dict[str, Stage]:
    from dvc.dependency.param import ParamsDependency
    from dvc.repo import Repo
    from dvc.stage import PipelineStage

    own = {(root / "dvc.yaml").resolve(), root / "dvc.yaml"}
    with Repo(str(root)) as repo:
        graph = repo.index.graph  # an edge goes from a stage to a stage it depends on
        # dvc.yaml's stages only: a `dvc add`ed folder or file (data/raw/*.dvc, baseline/*.dvc) is a node too
        nodes = [n for n in graph.nodes if isinstance(n, PipelineStage) and Path(n.path) in own]
        found = {}
        for stage in nodes:
            found[stage.name] = Stage(
                name=stage.name,
                cmd=stage.cmd if isinstance(stage.cmd, str) else " && ".join(stage.cmd),
                deps=tuple(
                    PARAMS_DEP if isinstance(dep, ParamsDependency) else str(dep.def_path).rstrip("/")
                    for dep in stage.deps
                ),
                outs=tuple(str(out.def_path).rstrip("/") for out in stage.outs),
                uncached=tuple(str(out.def_path).rstrip("/") for out in stage.outs if not out.use_cache),
                upstream=frozenset(up.name for up in graph.successors(stage) if up in nodes),
                always_changed=bool(stage.always_changed),
            )
    return found


def load_stages(root: Path = Path(".")) -> dict[str, Stage]:
    """The stages of `root`'s dvc.yaml, in an order where every stage follows its upstream ones."""
    key = hashlib.sha256(b"\0".join(_resolution_inputs(root))).hexdigest()[:16]
    kept = root / ".dvc" / "tmp" / f"imagepipe-dag-{key}.json"
    stages = None
    with contextlib.suppress(OSError, ValueError, TypeError):
        stages = {
            s["name"]: Stage(
                **{**s, **{k: tuple(s[k]) for k in ("deps", "outs", "uncached")}, "upstream": frozenset(s["upstream"])}
            )  # fmt: skip
            for s in json.loads(kept.read_text())
        }
    if stages is None:
        try:
            stages = _from_dvc(root)
        except Exception as exc:  # DVC's own errors (a bad ${} key, no DVC repository) have no common base
            raise DagError(f"{root / 'dvc.yaml'}: DVC cannot resolve it ({type(exc).__name__}: {exc})") from None
        with contextlib.suppress(OSError):
            kept.parent.mkdir(parents=True, exist_ok=True)
            tmp = kept.with_suffix(f".{os.getpid()}.tmp")
            rows = [{**dataclasses.asdict(s), "upstream": sorted(s.upstream)} for s in stages.values()]
            tmp.write_text(json.dumps(rows, sort_keys=True))
            os.replace(tmp, kept)
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
