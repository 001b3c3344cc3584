"""`make add-data SRC=/path/to/images NAME=pets`: an ImageFolder becomes versioned data of this project.

SRC is checked as an ImageFolder (at least two class folders, or split folders train/val/test holding them),
copied to data/raw/NAME (written beside it and renamed in, so a failed copy leaves nothing that looks
complete), `dvc add`ed, and params.yaml's `data.source` is pointed at it (DVC's own params writer, the one
`dvc exp run -S` uses, so the rest of the file stays as it is). SRC itself is never modified. Then commit
data/raw/NAME.dvc, data/raw/.gitignore and params.yaml, and `dvc push` stores the images: any commit can
rebuild its model from the data it was trained on.

`make add-data SRC=new/ INTO=pets` grows data/raw/pets instead (tasks/tools/data_merge.py): new images merged in,
duplicates skipped, `dvc add`ed again, data.source left as it is. That is how the server's review folder
(serve.review_dir) comes in: what was taken then leaves the review folder.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tasks.core.cli import stage_main
from tasks.core.errors import StageError
from tasks.core.params import PARAMS_FILE, Params
from tasks.core.private_api import set_params
from tasks.images.layout import read_layout
from tasks.tools.data_merge import merge

log = logging.getLogger(__name__)
RAW = Path("data/raw")
NAME_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def grow(src: Path, name: str, *, params: Params, raw_dir: Path = RAW) -> Path:
    """Merge `src` into the DVC-tracked raw_dir/name (`make add-data ... INTO=name`); returns that folder."""
    if not NAME_RULE.fullmatch(name):
        raise StageError(f"INTO {name!r}: use letters, digits, '.', '_' or '-' (at most 64, no '/'): the name of a "
                         "dataset under data/raw/, e.g. INTO=pets")  # fmt: skip
    dest = raw_dir / name
    merge(src, name, dest, params=params)
    return dest


def run(src: Path, name: str, *, raw_dir: Path = RAW, params_file: Path = PARAMS_FILE) -> Path:
    """Copy `src` to raw_dir/name, `dvc add` it, set data.source; returns the new folder."""
    if not NAME_RULE.fullmatch(name):
        raise StageError(f"NAME {name!r}: use letters, digits, '.', '_' or '-' (at most 64, no '/'), e.g. NAME=pets")
    layout = read_layout(Path(src), what="SRC")
    dest = raw_dir / name
    if dest.exists() or dest.with_name(f"{name}.dvc").exists():
        raise StageError(f"NAME {name}: {dest} already exists; choose another NAME, or `dvc remove {dest}.dvc` first")
    if Path(src).resolve() in dest.resolve().parents:  # the copy would land inside what it copies
        raise StageError(f"SRC {src}: contains {dest}; bring in a folder outside data/raw/")
    raw_dir.mkdir(parents=True, exist_ok=True)
    staging = raw_dir / f".{name}.tmp-{os.getpid()}"
    try:
        shutil.copytree(src, staging, symlinks=False, ignore=shutil.ignore_patterns(".*"))
        os.replace(staging, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-m", "dvc", "add", str(dest)], capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(dest, ignore_errors=True)  # nothing half-added stays behind
        raise StageError(f"dvc add {dest} failed, nothing was added:\n{proc.stdout}{proc.stderr}".rstrip())

    set_params(params_file, [f"data.source={dest}"])
    files = sum(1 for p in dest.rglob("*") if p.is_file())
    log.info("%s -> %s: %d files in %d classes %s (%s), tracked by DVC (%s.dvc); params.yaml data.source = %s",
             src, dest, files, len(layout.class_names), list(layout.class_names), layout.kind, dest, dest)  # fmt: skip
    log.info("to keep it: git add %s.dvc %s/.gitignore %s && git commit -m 'data: %s' && dvc push",
             dest, raw_dir, params_file, name)  # fmt: skip
    return dest


def _main(params: Params) -> None:
    parser = argparse.ArgumentParser(prog="python -m tasks.tools.add_data", description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="an ImageFolder: SRC/<class>/<image> or SRC/<split>/<class>/<image>")
    parser.add_argument("name", nargs="?", help="a new dataset: the folder name under data/raw/")
    parser.add_argument("--into", help="an existing DVC-tracked dataset under data/raw/ to merge SRC into")
    args = parser.parse_args()
    if (args.name is None) == (args.into is None):
        parser.error("give NAME (a new dataset) or --into NAME (grow one), not both or neither")
    if args.into is not None:
        grow(args.src, args.into, params=params)
    else:
        run(args.src, args.name)


def main() -> None:
    stage_main("add-data", _main)


if __name__ == "__main__":
    main()
