"""Fix-in-place: a label-error candidate's dataset file (its sidecar's `file`) -> the class folder the reviewer
filed the candidate under, inside the DVC-tracked data/raw/<name> (the same split folder, below the wrappers, as
tasks/images/layout.py reads them), then `dvc add data/raw/<name>`; its copy leaves the review folder.

Refused, before anything moves, when the file is not in a tracked dataset, the dataset differs from its .dvc file,
DVC is at work or the decision log cannot be read. A failed move, `dvc add` or log write puts every file and the
.dvc file back. Undo reverses it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from tasks.core.errors import StageError
from tasks.images.class_names import check_class_name
from tasks.images.layout import read_layout
from tasks.tools.add_data import RAW
from tasks.tools.data_merge import check_dataset_is_committed
from tasks.tools.review.dvc_lock import check_unlocked
from tasks.tools.review.items import Item, resolve
from tasks.tools.review.refusals import BadInput, Gone, Refusal
from tasks.tools.review.state import Dataset, Review, dataset_holding

T = TypeVar("T")


def dataset_of(review: Review, file: Path) -> Dataset:
    """The DVC-tracked data/raw/<name> that holds `file`, or one line on how to make its folder one."""
    dataset = dataset_holding(file)
    if dataset is not None and dataset.dest.resolve() != file.resolve():
        return dataset
    source = Path(review.params.data.source)
    folder = source if source.resolve() in file.resolve().parents else file.parent.parent
    raise Refusal(f"fix-in-place: {file} is not in a DVC-tracked dataset under {RAW}/; make one: `make add-data "
                  f"SRC={folder} NAME=shapes`, `make run`, `make review-label-errors`")  # fmt: skip


def _target(item: Item, dataset: Dataset, file: Path) -> Path:
    """Where `file` goes: the same split folder of the dataset, class folder item.folder."""
    layout = read_layout(dataset.dest, what=f"dataset {dataset.dest}")
    roots = layout.split_roots()
    for split, folder in roots.items():
        if folder.resolve() in file.resolve().parents:
            rel = file.resolve().relative_to(folder.resolve())
            if len(rel.parts) < 2:
                break
            cls = check_class_name(item.folder, layout.class_names)
            new = folder / cls / Path(*rel.parts[1:])
            if cls != rel.parts[0] and split != "train" and not (roots["train"] / cls).is_dir():
                raise Refusal(f"fix-in-place: {file} is in the {split} folder and class {cls} has no folder in "
                              f"{roots['train']}: every class needs training images")  # fmt: skip
            if cls != rel.parts[0] and os.path.lexists(new):
                raise Refusal(f"fix-in-place: {new} already exists; rename one of the two, nothing was moved")
            return new if cls != rel.parts[0] else file
    raise Refusal(f"fix-in-place: {file} is not in a class folder of {dataset.dest}; nothing was moved")


def _ready(review: Review, dataset: Dataset, action: str) -> None:
    check_unlocked(review.root, action)
    try:
        check_dataset_is_committed(dataset.name, dataset.dest, dataset.dvc_file)
    except StageError as exc:  # add-data's refusal speaks of INTO and a merge: the same, named for this action
        message = str(exc).removeprefix(f"INTO {dataset.name}: ").replace(", then merge", f", then {action} again")
        raise Refusal(f"{action}: {message}") from None


def move_in_dataset(dataset: Dataset, pairs: list[tuple[Path, Path]], then: Callable[[], T]) -> T:
    """Each (old, new) renamed, `dvc add`, then `then()` (the log write); any failure, `then`'s too, puts the files,
    new folders and .dvc file back."""
    before = dataset.dvc_file.read_bytes()
    moved: list[tuple[Path, Path]] = []
    made: list[Path] = []
    try:
        for old, new in pairs:
            for folder in reversed(new.parents):
                if dataset.dest in folder.parents and not folder.exists():
                    folder.mkdir()
                    made.append(folder)
            os.replace(old, new)
            moved.append((old, new))
        if moved:
            proc = subprocess.run([sys.executable, "-m", "dvc", "add", str(dataset.dest)], capture_output=True,
                                  text=True)  # fmt: skip
            if proc.returncode != 0:
                raise Refusal(f"dvc add {dataset.dest} failed, nothing was moved:\n{proc.stdout}{proc.stderr}".rstrip())
        return then()
    except BaseException:
        for old, new in reversed(moved):
            os.replace(new, old)
        for folder in reversed(made):
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        dataset.dvc_file.write_bytes(before)
        raise


def fix_in_place(review: Review, refs: list[tuple[str, str]]) -> dict[str, Any]:
    """The candidates of `refs` fixed into the class folders they are filed under; returns the log lines and the
    git command that keeps the dataset's new version."""
    with review.lock:
        items = resolve(review, refs)
        plans: list[tuple[Item, Path, Path]] = []
        datasets: dict[str, Dataset] = {}
        for item in items:
            if not item.candidate:
                raise BadInput(f"fix-in-place: image {item.id[:12]} is no label-error candidate: label it instead")
            file = Path(str(item.sidecar.get("file") or ""))
            dataset = dataset_of(review, file)
            datasets[dataset.name] = dataset
            if not file.is_file():
                raise Gone(f"fix-in-place: {file} (image {item.id[:12]}) is gone; nothing was moved (`dvc status "
                           f"{dataset.dvc_file}`)")  # fmt: skip
            plans.append((item, file, _target(item, dataset, file)))
        if len(datasets) > 1:
            raise BadInput(f"fix-in-place: the selected candidates are in {len(datasets)} datasets "
                           f"({', '.join(sorted(datasets))}); fix one dataset's at a time")  # fmt: skip
        (dataset,) = datasets.values()
        _ready(review, dataset, "fix-in-place")
        pending = review.log.plan([{"what": "fix-in-place", "sha256": item.id, "from": file.as_posix(),
                                    "to": new.as_posix(), "dataset": dataset.dvc_file.as_posix(),
                                    "review_copy": f"{item.folder}/{item.name}", "sidecar": item.sidecar}
                                   for item, file, new in plans])  # fmt: skip
        pairs = [(file, new) for _, file, new in plans if new != file]
        written = move_in_dataset(dataset, pairs, lambda: review.log.write(pending))
        for item, _, _ in plans:  # the image first: an image never lacks its sidecar
            copy = review.review_dir / item.folder / item.name
            copy.unlink(missing_ok=True)
            copy.with_suffix(".json").unlink(missing_ok=True)
        return {
            "entries": written,
            "moved": len(pairs),
            "dataset": str(dataset.dest),
            "keep": keep_command(review, dataset, f"{len(pairs)} label(s) fixed in place"),
        }


def undo_fix(review: Review, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The dataset files back where they were (`dvc add` again), the copies and sidecars back in the review folder,
    the undo lines written; returns them."""
    dataset = dataset_of(review, Path(batch[0]["from"]))
    pairs = []
    for entry in batch:
        old, new, copy = Path(entry["from"]), Path(entry["to"]), review.review_dir / entry["review_copy"]
        if not new.is_file():
            raise Refusal(f"undo: {new} is no longer where the fix-in-place put it; nothing was moved")
        if old != new and os.path.lexists(old):
            raise Refusal(f"undo: {old} exists again; nothing was moved")
        if os.path.lexists(copy):
            raise Refusal(f"undo: {copy} exists again; nothing was moved")
        if old != new:
            pairs.append((new, old))
    _ready(review, dataset, "undo")
    pending = review.log.plan([{"what": "undo", "undoes": e["batch"], "undid": "fix-in-place", "sha256": e["sha256"],
                                "from": e["to"], "to": e["from"], "review_copy": e["review_copy"]}
                               for e in batch])  # fmt: skip

    def copies_back_then_log() -> list[dict[str, Any]]:
        restored: list[Path] = []
        try:
            for entry in batch:  # the sidecar first, as the server writes them
                copy = review.review_dir / entry["review_copy"]
                copy.parent.mkdir(parents=True, exist_ok=True)
                restored.append(copy)
                copy.with_suffix(".json").write_text(json.dumps(entry["sidecar"], indent=2))
                copy.write_bytes(Path(entry["from"]).read_bytes())
            return review.log.write(pending)
        except BaseException:
            for copy in restored:
                copy.unlink(missing_ok=True)
                copy.with_suffix(".json").unlink(missing_ok=True)
            raise

    return move_in_dataset(dataset, pairs, copies_back_then_log)


def keep_command(review: Review, dataset: Dataset, what: str) -> str:
    """The git command that keeps the dataset's new version (and its decision log, when it is beside it)."""
    log = f" {review.log.path}" if review.dataset == dataset else ""
    return f"git add {dataset.dvc_file}{log} && git commit -m 'data: {dataset.name}: {what}' && dvc push"
