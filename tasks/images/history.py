"""The dataset's growth as DVC versions it: data.source's .dvc file -> the generation of each image's bytes.

`make add-data INTO=` lists the sha256 of the images each merge added in the dataset's .dvc file
(`meta.merges[k].images`, tasks/tools/merge_plan.py). An image first listed by the k-th such merge is of
generation k + 1; every other image (the first version, merges recorded before the lists were, a folder DVC does
not track) is of generation 0. Preprocess lays shards out by generation, so a merge's images go into shards of
their own and the old shards keep their bytes; a rebuild from scratch reads the same .dvc file and lays them out
the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tasks.core.errors import StageError


def dvc_file_of(source: Path, repo: Path = Path()) -> Path | None:
    """The .dvc file that tracks `source` in the repository `repo`: beside it, or beside the nearest folder above it
    (below `repo`) that has one."""
    source, root = Path(source).resolve(), Path(repo).resolve()
    for folder in [source, *source.parents]:
        if folder == root or root not in folder.parents:
            return None
        candidate = folder.with_name(folder.name + ".dvc")
        if candidate.is_file():
            return candidate
    return None


def generations(source: Path) -> tuple[dict[str, int], int]:
    """{image sha256: generation} for the images some recorded merge added, and the number of generations."""
    dvc_file = dvc_file_of(source)
    if dvc_file is None:
        return {}, 1
    try:
        document: Any = yaml.safe_load(dvc_file.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise StageError(f"{dvc_file}: cannot be read as a .dvc file ({exc})") from None
    merges = (document.get("meta") or {}).get("merges") or [] if isinstance(document, dict) else []
    found: dict[str, int] = {}
    generation = 0
    for merge in merges:
        images = merge.get("images") if isinstance(merge, dict) else None
        if not images:
            continue  # counts only (a merge recorded before the lists were): its images stay in generation 0
        generation += 1
        for digest in images:
            found.setdefault(str(digest), generation)
    return found, generation + 1
