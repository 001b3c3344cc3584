"""`make warm-start`: the production model's weights become paths.parent, what train.warm_start starts from.

The production model is the promoted baseline's (baseline/model.onnx, make promote) when there is one, else
the last export's (tasks/release/production.py). Its PyTorch weights are baseline/model.pt (promote keeps it)
or paths.model; either is used only when its sha256 is the `model_sha256` the verified ONNX records, so the
parent is exactly the model users are served. The file is copied to paths.parent/model.pt beside parent.json
(its sha256, the ONNX's, where it came from) and `dvc add`ed; commit model.pt.dvc and parent.json and
`dvc push`. Then `dvc exp run -S train.warm_start.enabled=true` (or set it in params.yaml) trains from it.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from typing import Any

from tasks.core.cli import stage_main
from tasks.core.errors import StageError
from tasks.core.io import sha256_file, write_json
from tasks.core.params import Params
from tasks.core.paths import Paths
from tasks.release.production import production_model
from tasks.training.warm_start import PARENT_MODEL, PARENT_RECORD

log = logging.getLogger(__name__)


def run(paths: Paths, *, track_with_dvc: bool = True) -> dict[str, Any]:
    """Copy the production model's model.pt into paths.parent with its record; returns the record."""
    production = production_model(paths)
    onnx = production.load()  # its bytes checked against the recorded hash before onnxruntime reads them
    wanted = onnx.metadata.get("model_sha256")
    weights = paths.baseline_weights if production.source == "baseline" else paths.model
    if not weights.is_file():
        why = ("it was promoted before make promote kept model.pt; promote a model again"
               if production.source == "baseline" else "run `dvc repro train` or `dvc pull`")  # fmt: skip
        raise StageError(f"make warm-start: {weights} (the weights of {production.detail}) is missing: {why}")
    digest = sha256_file(weights)
    if digest != wanted:
        raise StageError(f"make warm-start: {weights} has sha256 {digest[:16]}..., but the production model "
                         f"{production.path} was exported from {str(wanted)[:16]}...; run `dvc repro` (or "
                         "`dvc checkout`) so the two agree")  # fmt: skip
    folder = paths.parent
    folder.mkdir(parents=True, exist_ok=True)
    dest, record_path = folder / PARENT_MODEL, folder / PARENT_RECORD
    record = {"model_sha256": digest, "onnx_sha256": production.expected_sha256, "source": production.source,
              "detail": production.detail, "class_names": list(onnx.class_names)}  # fmt: skip
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    try:  # the weights first, then the record that vouches for them: a crash leaves no record of other bytes
        shutil.copyfile(weights, tmp)
        if sha256_file(tmp) != digest:
            raise StageError(f"make warm-start: {weights} changed while it was copied; run it again")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    write_json(record_path, record)
    if track_with_dvc:
        proc = subprocess.run([sys.executable, "-m", "dvc", "add", str(dest)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise StageError(f"dvc add {dest} failed:\n{proc.stdout}{proc.stderr}")
    return record


def _main(params: Params) -> None:
    record = run(params.paths)
    folder = params.paths.parent
    log.info("parent <- %s (model.pt sha256 %s...); train.warm_start.enabled: true trains from it. To keep it: "
             "git add %s/%s.dvc %s/%s && git commit, then dvc push", record["detail"], record["model_sha256"][:16],
             folder, PARENT_MODEL, folder, PARENT_RECORD)  # fmt: skip


def main() -> None:
    stage_main("warm-start", _main)


if __name__ == "__main__":
    main()
