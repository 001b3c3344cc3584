"""Stage preprocess: an ImageFolder (root/<class>/<image>) -> checksummed uint8 Arrow shards.

Every file is fully decoded in worker processes; unreadable files are quarantined with a reason,
non-image names are ignored, and seen == accepted + quarantined + ignored. Each image's split is a
function of its bytes and the seed, so adding images never moves an existing one.
"""

from __future__ import annotations

import logging
import multiprocessing
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError
from tqdm import tqdm

from tasks.cli import StageError, stage_main
from tasks.imaging import PreprocessSpec, is_image_name, load_array
from tasks.io import atomic_dir, dumps_json, sha256_bytes
from tasks.params import PreprocessParams, derive_seed
from tasks.shards import FORMAT_VERSION, MANIFEST, QUARANTINE, SPLITS, class_counts, write_shard

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreprocessResult:
    counts: dict[str, int]
    split_counts: dict[str, int]
    class_names: tuple[str, ...]
    out_dir: Path


def discover(source: Path) -> tuple[tuple[str, ...], list[tuple[str, int]], list[dict[str, str]]]:
    """List (relative path, label) of candidate images, and the files ignored by name."""
    if not source.is_dir():
        raise StageError(f"data.source {source}: not a directory (expected root/<class>/<image>)")
    classes = tuple(sorted(p.name for p in source.iterdir() if p.is_dir() and not p.name.startswith(".")))
    if len(classes) < 2:
        raise StageError(f"data.source {source}: found {len(classes)} class folders, need at least 2")
    candidates, ignored = [], []
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        rel = path.relative_to(source).as_posix()
        parts = rel.split("/")
        if len(parts) < 2 or parts[0] not in classes:
            ignored.append({"path": rel, "reason": "outside_class_folder"})
        elif any(part.startswith(".") for part in parts) or not is_image_name(path):
            ignored.append({"path": rel, "reason": "hidden" if parts[-1].startswith(".") else "not_image_name"})
        else:
            candidates.append((rel, classes.index(parts[0])))
    return classes, candidates, ignored


def split_of(file_sha256: str, seed: int, val_fraction: float, test_fraction: float) -> str:
    """train/val/test from the file's bytes (via its hash) and the seed alone."""
    u = derive_seed(seed, "split", file_sha256) / 2**63
    if u < test_fraction:
        return "test"
    return "val" if u < test_fraction + val_fraction else "train"


_WORKER: dict[str, Any] = {}


def _init_worker(source: Path, spec: PreprocessSpec) -> None:
    _WORKER.update(source=source, spec=spec)


def _detail(exc: BaseException) -> str:
    """The error message without object addresses, so the quarantine report is byte-stable."""
    return re.sub(r" ?<[^>]* at 0x[0-9a-f]+>", "", str(exc))


def _process(item: tuple[str, int]) -> tuple[str, int, str, np.ndarray | None, str, str]:
    rel, label = item
    data = (_WORKER["source"] / rel).read_bytes()
    digest = sha256_bytes(data)
    if not data:
        return rel, label, digest, None, "empty_file", "zero bytes"
    try:
        return rel, label, digest, load_array(data, _WORKER["spec"]), "", ""
    except Image.DecompressionBombError as exc:
        return rel, label, digest, None, "decompression_bomb", _detail(exc)
    except UnidentifiedImageError as exc:
        return rel, label, digest, None, "not_an_image", _detail(exc)
    except (OSError, ValueError, SyntaxError) as exc:
        reason = "truncated" if "truncated" in str(exc).lower() else "decode_error"
        return rel, label, digest, None, reason, _detail(exc)


def run(params: PreprocessParams, *, seed: int, source: Path, out_dir: Path) -> PreprocessResult:
    source = Path(source)
    class_names, candidates, ignored = discover(source)
    spec = PreprocessSpec(
        image_size=params.image_size,
        interpolation=params.interpolation,
        mean=params.mean,
        std=params.std,
        class_names=class_names,
    )
    accepted: list[tuple[str, int, str, np.ndarray]] = []
    quarantined: list[dict[str, str]] = []
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(params.workers, initializer=_init_worker, initargs=(source, spec)) as pool:
        results = pool.imap(_process, candidates, chunksize=32)
        for rel, label, digest, array, reason, detail in tqdm(
            results, total=len(candidates), desc="preprocess", unit="img", mininterval=1.0
        ):
            if array is None:
                quarantined.append({"path": rel, "reason": reason, "detail": detail})
            else:
                accepted.append((rel, label, digest, array))

    split_seed = derive_seed(seed, "preprocess")
    files, by_split = [], {name: [] for name in SPLITS}
    for rel, label, digest, array in accepted:
        split = split_of(digest, split_seed, params.val_fraction, params.test_fraction)
        files.append({"path": rel, "label": label, "sha256": digest, "split": split})
        by_split[split].append((array, label))

    split_counts = {split: len(items) for split, items in by_split.items()}
    if not by_split["train"] or not by_split["test"]:
        raise StageError(f"data.source {source}: too few images to fill train and test splits ({split_counts})")
    counts = {
        "seen": len(candidates) + len(ignored),
        "accepted": len(accepted),
        "quarantined": len(quarantined),
        "ignored": len(ignored),
    }
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "image_size": params.image_size,
        "class_names": list(class_names),
        "spec": spec.model_dump(mode="json"),
        "counts": counts,
        "splits": {},
        "files": files,
    }
    with atomic_dir(out_dir) as tmp:
        for split, items in by_split.items():
            shards = []
            for start in range(0, len(items), params.shard_size):
                chunk = items[start : start + params.shard_size]
                images = np.stack([array for array, _ in chunk])
                labels = np.array([label for _, label in chunk])
                shards.append(write_shard(tmp / f"{split}-{len(shards):05d}.arrow", images, labels))
            manifest["splits"][split] = {
                "count": len(items),
                "class_counts": class_counts([label for _, label in items], len(class_names)),
                "shards": shards,
            }
        (tmp / MANIFEST).write_text(dumps_json(manifest))
        (tmp / QUARANTINE).write_text(dumps_json({"quarantined": quarantined, "ignored": ignored, "counts": counts}))

    for reason, count in sorted(Counter(q["reason"] for q in quarantined).items()):
        log.info("quarantined %d files: %s", count, reason)
    log.info("%s; splits %s; %d classes -> %s", counts, split_counts, len(class_names), out_dir)
    return PreprocessResult(counts, split_counts, class_names, Path(out_dir))


def main() -> None:
    stage_main(
        "preprocess",
        lambda p: run(p.preprocess, seed=p.seed, source=p.data.source, out_dir=p.paths.shards),
    )


if __name__ == "__main__":
    main()
