"""The review folder -> the images to review: where each is, what the model guessed (top 3), why it was kept,
when it arrived, and whether a decision that stands has filed it; the classes and the key of each.

An image is `<review_dir>/<class folder>/<name>` with its sidecar (the server's low-confidence uploads,
`make review-label-errors`' candidates), as tasks/images/review_folder.py defines them; its id is the sha256 of
its bytes, so two images of one name in two classes, or of one stem in one folder, are two cards.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from tasks.core.errors import StageError
from tasks.images import review_folder
from tasks.images.imaging import is_image_name
from tasks.images.layout import read_layout
from tasks.images.review_folder import image_id, images_in, sidecar_of
from tasks.tools.review.decisions import last_touch, standing_by_image
from tasks.tools.review.refusals import BadInput, Gone, Refusal
from tasks.tools.review.state import Review

KEYS = "1234567890qwertyiopasdghjklcvbm"  # one per class, in order; x u f z n are the page's own keys
ID_RULE = re.compile(r"[0-9a-f]{64}")  # a sha256


@dataclass(frozen=True)
class Item:
    id: str
    folder: str  # the class folder it is in now, relative to the review folder
    name: str
    sidecar: dict[str, Any]

    @property
    def candidate(self) -> bool:
        return self.sidecar.get("source") == "label_errors"

    @property
    def guess(self) -> str | None:
        return self.sidecar.get("suggested" if self.candidate else "predicted")

    @property
    def confidence(self) -> float | None:
        value = self.sidecar.get("p_suggested" if self.candidate else "top1_probability")
        return float(value) if isinstance(value, int | float) else None

    def top3(self) -> list[tuple[str, float]]:
        if self.candidate:
            pairs = [(self.sidecar.get(c), self.sidecar.get(f"p_{c}")) for c in ("suggested", "given", "predicted")]
            found = dict(reversed([(c, float(p)) for c, p in pairs if c is not None and p is not None]))
        else:
            found = {c: float(p) for c, p in (self.sidecar.get("probabilities") or {}).items()}
            if not found and self.guess is not None and self.confidence is not None:
                found = {self.guess: self.confidence}
        return sorted(found.items(), key=lambda cp: -cp[1])[:3]

    def reason(self) -> str:
        s = self.sidecar
        if self.candidate:
            return (f"label-error candidate: the dataset says {s.get('given')} (p {float(s.get('p_given', 0)):.3f}); "
                    f"rank {s.get('rank')}, {s.get('split')} split")  # fmt: skip
        if self.confidence is not None:
            margin = s.get("margin")
            more = f", margin {float(margin):.2f}" if isinstance(margin, int | float) else ""
            return f"low confidence: top-1 {self.confidence:.2f}{more}"
        return "no sidecar: put here by hand"

    def to_json(self, standing: dict[str, Any] | None, dataset: Path | None = None) -> dict[str, Any]:
        """For the page; `dataset`: the page's dataset folder, whose files (a candidate's) it serves too."""
        filed = standing is not None and standing["what"] == "label" and standing["to"] == self.folder
        file_url = None
        if self.candidate and dataset is not None:
            file = Path(str(self.sidecar.get("file"))).resolve()
            if dataset.resolve() in file.parents:
                file_url = f"img/dataset/{quote(file.relative_to(dataset.resolve()).as_posix())}"
        return {"id": self.id, "folder": self.folder, "name": self.name, "guess": self.guess,
                "confidence": self.confidence, "top3": self.top3(), "reason": self.reason(),
                "saved_at": self.sidecar.get("saved_at"), "candidate": self.candidate,
                "given": self.sidecar.get("given"), "file": self.sidecar.get("file") if self.candidate else None,
                "decided": {"by": standing["who"], "when": standing["when"]} if filed else None,
                "url": f"img/review/{quote(self.folder)}/{quote(self.name)}", "file_url": file_url}  # fmt: skip


def _item(image: Path, folder: str) -> Item | None:
    try:
        sha = image_id(image)
    except OSError:  # gone meanwhile
        return None
    return Item(sha, folder, image.name, sidecar_of(image, sha))


def class_folders(review: Review) -> list[str]:
    return review_folder.class_folders(review.review_dir)


def list_items(review: Review) -> list[Item]:
    found = (_item(p, folder) for folder in class_folders(review) for p in images_in(review.review_dir / folder))
    return [item for item in found if item is not None]


def sort_items(items: list[Item], sort: str, guess: str | None) -> list[Item]:
    """confidence: least sure first (no sidecar last); newest / oldest: by saved_at. `guess`: that class only."""
    chosen = [i for i in items if guess is None or i.guess == guess]
    if sort == "newest":
        return sorted(chosen, key=lambda i: i.sidecar.get("saved_at") or "", reverse=True)
    if sort == "oldest":
        return sorted(chosen, key=lambda i: i.sidecar.get("saved_at") or "")
    return sorted(chosen, key=lambda i: (i.confidence is None, i.confidence or 0.0, i.id))


def classes(review: Review, items: list[Item]) -> list[dict[str, str | None]]:
    """The dataset's classes first, then the review folder's and the model's others, then those typed on the page;
    each with its key (the first len(KEYS))."""
    names: list[str] = []
    source = review.dataset.dest if review.dataset else Path(review.params.data.source)
    with contextlib.suppress(StageError):  # the generated data before `make run`: the review folder's own classes
        names += read_layout(source).class_names
    names += class_folders(review) + sorted({i.guess for i in items if i.guess}) + review.new_classes
    ordered = list(dict.fromkeys(names))
    return [{"name": n, "key": KEYS[i] if i < len(KEYS) else None} for i, n in enumerate(ordered)]


def safe_folder(review: Review, folder: str) -> Path:
    """review_dir/folder, refused unless it is a folder one or two names deep inside the review folder."""
    parts = Path(folder).parts
    if not parts or len(parts) > 2 or Path(folder).is_absolute() or any(p in ("", ".", "..") for p in parts):
        raise BadInput(f"folder {folder!r}: not a class folder of the review folder {review.review_dir}")
    return review.review_dir / folder


def _has_id(image: Path, sha256: str) -> bool:
    try:
        return image_id(image) == sha256
    except OSError:
        return False


def find(review: Review, sha256: str, folder: str) -> Item | None:
    """The image of that id in that folder of the review folder, or None."""
    if not ID_RULE.fullmatch(sha256):
        raise BadInput(f"image id {sha256!r}: no such image in the review folder")
    path = next((p for p in images_in(safe_folder(review, folder)) if _has_id(p, sha256)), None)
    return None if path is None else Item(sha256, folder, path.name, sidecar_of(path, sha256))


def locate(review: Review, sha256: str) -> list[Path]:
    """Every image of that id anywhere in the review folder, hidden folders too."""
    if not review.review_dir.is_dir():
        return []
    found = (p for p in review.review_dir.rglob("*") if is_image_name(p.name) and p.is_file())
    return sorted(p for p in found if _has_id(p, sha256))


def resolve(review: Review, refs: list[tuple[str, str]]) -> list[Item]:
    """The images where the page saw them ((id, folder) each), or one refusal for the first that is not there:
    409 when it is in another folder now (who moved it, where, when, from the log), 410 when it is gone."""
    found = []
    for sha256, folder in refs:
        item = find(review, sha256, folder)
        if item is not None:
            found.append(item)
            continue
        short, entries = sha256[:12], review.log.entries()
        touch = last_touch(entries, sha256)
        elsewhere = [p.parent.relative_to(review.review_dir).as_posix() for p in locate(review, sha256)]
        if elsewhere:
            if touch is not None and touch.get("to") in elsewhere:
                raise Refusal(f"image {short} is no longer in {folder}/: {touch['who']} moved it to {touch['to']}/ "
                              f"at {touch['when']} ({touch['what']}); reload the page")  # fmt: skip
            raise Refusal(f"image {short} is no longer in {folder}/: it is in {elsewhere[0]}/ now, moved outside "
                          "this page; reload the page")  # fmt: skip
        standing = standing_by_image(entries).get(sha256)
        if standing is not None and standing["what"] in ("take-in", "fix-in-place"):
            raise Gone(f"image {short} is gone from the review folder: {standing['who']} "
                       f"{'took it in to' if standing['what'] == 'take-in' else 'fixed it in place in'} "
                       f"{standing['to']} at {standing['when']}; reload the page")  # fmt: skip
        raise Gone(f"image {short} ({folder}/) is gone from the review folder; reload the page")
    return found


def standing_of(review: Review) -> dict[str, dict[str, Any]]:
    return standing_by_image(review.log.entries())
