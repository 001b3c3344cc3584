"""What the review page works on: the project root, the review folder, the DVC-tracked dataset under data/raw/
(`make review INTO=<name>`, else the one params.yaml's data.source is in, else none), and the decision log.

The log lives beside the dataset (data/raw/<name>.decisions.jsonl, committed with its .dvc file); with no
tracked dataset, in the review folder as <review_dir>/.decisions.jsonl (hidden: no merge or reader takes it).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from tasks.core.git import author
from tasks.core.params import Params
from tasks.tools.add_data import NAME_RULE, RAW
from tasks.tools.data_merge import check_dataset
from tasks.tools.review.decisions import DecisionLog
from tasks.tools.review.refusals import BadInput, Refusal

DISCARDED = ".discarded"  # hidden: tasks/images/layout.py and the merge ignore it; nothing in it is deleted


@dataclass(frozen=True)
class Dataset:
    name: str
    dest: Path  # data/raw/<name>
    dvc_file: Path  # data/raw/<name>.dvc


@dataclass
class Review:
    root: Path
    review_dir: Path
    params: Params
    dataset: Dataset | None
    log: DecisionLog
    new_classes: list[str] = field(default_factory=list)  # typed on the page, no folder yet
    lock: threading.RLock = field(default_factory=threading.RLock)  # one decision at a time, from every browser
    accepting: threading.Lock = field(default_factory=threading.Lock)  # one accept at a time, beside the decisions

    def need_dataset(self, action: str) -> Dataset:
        if self.dataset is None:
            source = self.params.data.source
            raise Refusal(f"{action}: this page has no DVC-tracked dataset under {RAW}/ (data.source is {source}); "
                          f"make one with `make add-data SRC={source} NAME=shapes`, then "
                          "`make review INTO=shapes`")  # fmt: skip
        return self.dataset


def dataset_holding(path: Path, raw_dir: Path = RAW) -> Dataset | None:
    """The DVC-tracked data/raw/<name> that is or holds `path` (a dataset folder, a file of it), or None."""
    raw, resolved = raw_dir.resolve(), path.resolve()
    if raw not in resolved.parents:
        return None
    name = resolved.relative_to(raw).parts[0]
    dest = raw_dir / name
    if not dest.is_dir() or not dest.with_name(f"{name}.dvc").is_file():
        return None
    return Dataset(name, dest, dest.with_name(f"{name}.dvc"))


def find_dataset(params: Params, into: str | None, review_dir: Path, raw_dir: Path = RAW) -> Dataset | None:
    """INTO's dataset (checked as add-data INTO= checks it), else the data/raw/<name> data.source is in, else None."""
    if into is not None:
        if not NAME_RULE.fullmatch(into):
            raise BadInput(f"INTO {into!r}: use letters, digits, '.', '_' or '-' (at most 64, no '/'): the name of a "
                           "dataset under data/raw/, e.g. INTO=pets")  # fmt: skip
        dest = raw_dir / into
        check_dataset(review_dir, into, dest, dest.with_name(f"{into}.dvc"))
        return Dataset(into, dest, dest.with_name(f"{into}.dvc"))
    return dataset_holding(Path(params.data.source), raw_dir)


def open_review(params: Params, into: str | None, root: Path | None = None) -> Review:
    root = Path.cwd() if root is None else root
    review_dir = Path(params.serve.review_dir)
    dataset = find_dataset(params, into, review_dir)
    log_path = dataset.dest.with_name(f"{dataset.name}.decisions.jsonl") if dataset else review_dir / ".decisions.jsonl"
    return Review(root, review_dir, params, dataset, DecisionLog(log_path, author(root)))
