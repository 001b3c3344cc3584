"""`make predict SRC=<image or folder> [OUT=predictions.csv] [MODEL=...]`: images -> one CSV row each, no server.

Runs in the torch-free serving venv, through the server's own code path: the model is loaded hash-verified
(default: what `make serve` serves, the promoted baseline or else models/model.onnx), each file is decoded
and resized by the preprocessing spec inside the model with the server's pixel limit, and scored by
onnxruntime in batches. Every file under a folder is a row, in path order (hidden files aside):

    path,label,probability,topk,error

`topk` is JSON, `[{"label": ..., "probability": ...}, ...]`, most likely first (`serve.top_k` of them). A
file that cannot be classified (truncated, not an image, a decompression bomb, unreadable, not a regular file:
a FIFO, a socket, a device, which are never opened) has an empty label and its reason in `error`, and the run
goes on. The CSV is written beside OUT and renamed in at the end, so an interrupted run leaves no half file
under OUT's name. Exit status (EXIT), each with its line on stderr:

    0  every file classified
    3  some files not classified: the last line counts them, by reason
    1  none classified
    2  bad arguments: SRC, OUT or the model, nothing written
    4  an internal error: its traceback, then one line that says so
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import stat
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

from tasks.core.environment import usable_cores
from tasks.core.params import ParamsError, Paths, ServeParams, load_params
from tasks.images.imaging import ImageError, load_array
from tasks.release.inference import ModelIntegrityError, ModelMetadataError, OnnxModel, ranked, softmax
from tasks.release.production import (
    ProductionModel,
    ProductionModelError,
    production_model,
    promoted_model,
    recorded_onnx_sha256,
)

HEADER = ("path", "label", "probability", "topk", "error")
EXIT = {"all": 0, "none": 1, "bad arguments": 2, "some": 3, "internal error": 4}
KINDS = {stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket", stat.S_ISCHR: "a character device",
         stat.S_ISBLK: "a block device"}  # fmt: skip
BATCH = 64  # images per onnxruntime call; decoding of a batch runs on a thread per core


class PredictError(Exception):
    """A bad SRC, OUT or model: one line, exit 2."""


@dataclass(frozen=True)
class Outcome:
    rows: int
    classified: int
    errors: Counter[str]
    seconds: float


def files_of(src: Path) -> list[Path]:
    """SRC itself when it is a file, else every file under it (symlinked folders followed), hidden ones aside."""
    if not src.exists():
        raise PredictError(f"SRC {src}: no such file or folder")
    if src.is_file():
        return [src]
    if not src.is_dir():
        raise PredictError(f"SRC {src}: {_kind(src.stat().st_mode)}, not an image file or a folder")
    found = []
    for folder, dirs, names in os.walk(src, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found.extend(Path(folder) / name for name in names if not name.startswith("."))
    if not found:
        raise PredictError(f"SRC {src}: a folder with no files in it")
    return sorted(found)


def load_model(model: Path | None, paths: Paths, threads: int) -> tuple[OnnxModel, str]:
    """The model and a line saying which one and how it was verified."""
    try:
        if model is None:
            chosen: ProductionModel = production_model(paths)
            return chosen.load(threads), chosen.detail
        resolved = model.resolve()
        if resolved == paths.onnx.resolve():
            digest = recorded_onnx_sha256(paths.export_report)
            return OnnxModel.load(model, expected_sha256=digest, threads=threads), (
                f"{model} (hash recorded in {paths.export_report})")  # fmt: skip
        promoted = promoted_model(paths)
        if promoted is not None and resolved == promoted.path.resolve():
            return promoted.load(threads), f"{model} ({promoted.detail})"
        if not model.is_file():
            raise PredictError(f"MODEL {model}: no such file")
        return OnnxModel.load(model, threads=threads), f"{model} (no recorded hash for this file: not verified)"
    except (ProductionModelError, ModelIntegrityError, ModelMetadataError, OSError) as exc:
        raise PredictError(str(exc).splitlines()[0]) from None


def _kind(mode: int) -> str:
    return next((name for test, name in KINDS.items() if test(mode)), "not a regular file")


def _decode(path: Path, model: OnnxModel, serve: ServeParams) -> np.ndarray | str:
    """uint8 (3, S, S) exactly as the server decodes an upload, or the reason this file cannot be. Only a regular
    file is opened: reading a FIFO would wait for a writer forever."""
    try:
        mode = path.stat().st_mode
        if not stat.S_ISREG(mode):
            return f"not_a_file: {_kind(mode)}, never opened"
        size = path.stat().st_size
        if size > serve.max_body_bytes:  # the server's limit on one upload: never read a huge file whole
            return f"too_large: {size} bytes > serve.max_body_bytes {serve.max_body_bytes}"
        return load_array(path.read_bytes(), model.spec, max_pixels=serve.max_pixels, limit="serve.max_pixels")
    except ImageError as exc:
        return f"{exc.reason}: {exc.detail}"
    except OSError as exc:
        return f"unreadable: {type(exc).__name__}: {exc.strerror or exc}"


def predictions(files: list[Path], model: OnnxModel, serve: ServeParams, workers: int) -> Iterator[dict[str, str]]:
    """One row per file, in order, decoded by `workers` threads a batch at a time and scored per batch."""
    with ThreadPoolExecutor(workers) as pool:
        for start in range(0, len(files), BATCH):
            chunk = files[start : start + BATCH]
            decoded = list(pool.map(lambda p: _decode(p, model, serve), chunk))
            good = [array for array in decoded if not isinstance(array, str)]
            probs = iter(softmax(model.logits(np.stack(good))) if good else [])
            for path, array in zip(chunk, decoded, strict=True):
                if isinstance(array, str):
                    yield {"path": str(path), "label": "", "probability": "", "topk": "", "error": array}
                    continue
                p = next(probs)
                order = ranked(p)[: serve.top_k]
                topk = [{"label": model.class_names[i], "probability": round(float(p[i]), 6)} for i in order]
                yield {"path": str(path), "label": model.class_names[order[0]],
                       "probability": f"{float(p[order[0]]):.6f}", "topk": json.dumps(topk), "error": ""}  # fmt: skip


def run(
    src: Path, out: Path, *, model: Path | None, paths: Paths, serve: ServeParams, progress: bool = True
) -> Outcome:
    files = files_of(src)
    if not out.resolve().parent.is_dir():
        raise PredictError(f"OUT {out}: its folder {out.parent} does not exist")
    if out.is_dir():
        raise PredictError(f"OUT {out}: a folder; name the CSV file to write")
    workers = usable_cores()
    onnx, which = load_model(model, paths, threads=0)
    print(f"[predict] {len(files)} file(s) from {src} with {which}", file=sys.stderr)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    classified, errors, started = 0, Counter[str](), time.perf_counter()
    try:
        with tmp.open("w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=HEADER)
            writer.writeheader()
            rows = predictions(files, onnx, serve, workers)
            bar = tqdm(rows, total=len(files), desc="predict", unit="img", disable=not progress or src.is_file())
            for row in bar:
                writer.writerow(row)
                if row["error"]:
                    errors[row["error"].split(":", 1)[0]] += 1
                else:
                    classified += 1
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return Outcome(len(files), classified, errors, time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except Exception as exc:  # a bug, not a bad input: its own status, so a script can tell it from "none classified"
        traceback.print_exc()
        print(f"[predict] internal error: {type(exc).__name__}: {exc} (exit {EXIT['internal error']}); the traceback "
              "above says where; please report it", file=sys.stderr)  # fmt: skip
        return EXIT["internal error"]


def _main(argv: list[str] | None) -> int:
    # serve.max_pixels is checked from each header before decoding; Pillow's own warning would only repeat it.
    warnings.simplefilter("ignore", Image.DecompressionBombWarning)
    parser = argparse.ArgumentParser(prog="python -m serving.predict", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="exit status:\n" + __doc__.rsplit("\n\n", 1)[-1])  # fmt: skip
    parser.add_argument("src", type=Path, help="an image file, or a folder of them (searched recursively)")
    parser.add_argument("--out", type=Path, default=Path("predictions.csv"), help="the CSV to write")
    parser.add_argument("--model", type=Path, default=None, help="an ONNX file (default: what make serve serves)")
    args = parser.parse_args(argv)
    try:
        params = load_params()
        outcome = run(args.src, args.out, model=args.model, paths=params.paths, serve=params.serve)
    except (PredictError, ParamsError) as exc:
        print(f"[predict] error: {'; '.join(line.strip() for line in str(exc).splitlines())}", file=sys.stderr)
        return EXIT["bad arguments"]
    rate = outcome.rows / outcome.seconds if outcome.seconds > 0 else float("inf")
    failed = ", ".join(f"{n} {reason}" for reason, n in outcome.errors.most_common())
    print(f"[predict] {outcome.classified} of {outcome.rows} classified ({rate:.0f} img/s) -> {args.out}",
          file=sys.stderr)  # fmt: skip
    if outcome.classified == 0:
        print(f"[predict] error: none of the {outcome.rows} file(s) in {args.src} could be classified "
              f"({failed}); each row of {args.out} says why", file=sys.stderr)  # fmt: skip
        return EXIT["none"]
    if outcome.errors:
        missed = outcome.rows - outcome.classified
        print(f"[predict] {missed} of {outcome.rows} file(s) not classified ({failed}; exit {EXIT['some']}); each "
              f"row of {args.out} says why", file=sys.stderr)  # fmt: skip
        return EXIT["some"]
    return EXIT["all"]


if __name__ == "__main__":
    sys.exit(main())
