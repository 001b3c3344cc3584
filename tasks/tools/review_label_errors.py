"""make review-label-errors: the top of reports/label_errors.json into the review folder (serve.review_dir).

    python -m tasks.tools.review_label_errors           # the 30 likeliest label errors
    python -m tasks.tools.review_label_errors --top 50

Each file goes where the server puts a low-confidence upload, so one review workflow takes both in
(docs/serving.md, low confidence): `<serve.review_dir>/<suggested class>/<sha256>.<ext>` with a
`<sha256>.json` sidecar naming the source file, its given class, the class the model likes best after the
given one (`suggested`), its score and probabilities.
Review each image: move it to the folder of its true class, and fix the source file's folder too (the
sidecar's `file`), then `dvc add` the source folder and rerun. Nothing in the source folder is changed
by this command; an image already in the review folder is left as it is.
"""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path

from tasks.core.cli import stage_main
from tasks.core.errors import StageError
from tasks.core.io import read_json, write_json
from tasks.core.params import Params
from tasks.tools.decision import utc_now

log = logging.getLogger(__name__)


def run(label_errors: Path, review_dir: Path, top: int) -> list[Path]:
    if not label_errors.is_file():
        raise StageError(f"{label_errors}: missing; run `dvc repro evaluate` first")
    copied = []
    for entry in read_json(label_errors)["likely_label_errors"][:top]:
        source = Path(entry["file"])
        if not source.is_file():
            raise StageError(f"{source}: listed in {label_errors} but not on disk (dvc pull, or rerun evaluate)")
        target = review_dir / entry["suggested"] / f"{entry['sha256']}{source.suffix.lower()}"
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        sidecar = {**entry, "source": "label_errors", "saved_at": utc_now()}
        write_json(target.with_suffix(".json"), sidecar)
        shutil.copyfile(source, target)  # the image last: an image in the folder always has its sidecar
        copied.append(target)
    return copied


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=30, help="how many of the likeliest label errors")
    args = parser.parse_args()

    def body(p: Params) -> None:
        copied = run(p.paths.label_errors, p.serve.review_dir, args.top)
        log.info("%d images -> %s/<suggested class>/ (with .json sidecars); review them, then fix the source folder",
                 len(copied), p.serve.review_dir)  # fmt: skip

    stage_main("review-label-errors", body)


if __name__ == "__main__":
    main()
