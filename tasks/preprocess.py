"""Stage preprocess: data.source [+ data.test_source] -> paths.shards: Arrow shards, manifest, quarantine.

Files are hashed, then fully decoded in worker processes; bad ones are quarantined with a reason, non-images ignored
(seen == accepted + quarantined + ignored); a file's split is a function of its bytes and the seed.
"""

from __future__ import annotations

import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tasks.core.cli import stage_main
from tasks.core.errors import StageError
from tasks.core.io import atomic_dir, dumps_json
from tasks.core.params import Params, PreprocessParams, derive_seed
from tasks.images.aspect import Aspect, choose_resize
from tasks.images.image_set import image_set_sha256
from tasks.images.imaging import PreprocessSpec
from tasks.images.layout import Layout, check_data_folders, read_layout
from tasks.images.report import check_usable, log_summary
from tasks.images.shards import (
    FORMAT_VERSION,
    MANIFEST,
    QUARANTINE,
    SPLITS,
    ShardWriter,
    class_counts,
    schema_description,
)
from tasks.images.splits import Plan, plan, split_of
from tasks.images.validation import (
    TEST_SOURCE,
    VAL_SOURCE,
    Candidate,
    CheckConfig,
    Checked,
    Hashed,
    check_file,
    discover,
    fixed_test_folder,
    hash_file,
    probe_shape,
    worker_init,
)
from tasks.images.workpool import isolated_map

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreprocessResult:
    counts: dict[str, int]
    split_counts: dict[str, int]
    class_names: tuple[str, ...]
    out_dir: Path


def _collect(layout: Layout) -> tuple[list[Candidate], list[Hashed], list[dict[str, str]]]:
    candidates: list[Candidate] = []
    sizes: list[Hashed] = []
    ignored: list[dict[str, str]] = []
    for role, folder in layout.roots:
        more, more_sizes, more_ignored = discover(folder, role=role, class_names=layout.class_names)
        candidates, sizes, ignored = candidates + more, sizes + more_sizes, ignored + more_ignored
    return candidates, sizes, ignored


def _bar(items: Any, total: int, desc: str) -> Any:
    return tqdm(items, total=total, desc=desc, unit="img", mininterval=1.0)


def run(
    params: PreprocessParams, *, seed: int, source: Path, out_dir: Path, test_source: Path | None = None,
    centred: bool = False,
) -> PreprocessResult:  # fmt: skip
    """`centred`: every subject of `source` is known to lie in the image's central square (the embedded default
    data, tasks/images/synth.py draws it so): `resize: auto` then crops whatever the aspect ratios."""
    layout = read_layout(Path(source), Path(test_source) if test_source is not None else None)
    log.info("data.source %s: %s, since %s", source, layout.kind, layout.why)
    if layout.missing_line():
        log.warning("data.source %s: %s", source, layout.missing_line())
    class_names, roots = layout.class_names, layout.roots
    candidates, hashes, ignored = _collect(layout)
    _hash_same_size(params.workers, roots, candidates, hashes)
    todo = plan(candidates, hashes, class_names)
    resize = _choose_resize(params, roots, todo, centred)
    spec = PreprocessSpec(
        image_size=params.image_size,
        resize=resize["mode"],
        interpolation=params.interpolation,
        mean=params.mean,
        std=params.std,
        class_names=class_names,
    )
    split_seed = derive_seed(seed, "preprocess")
    with atomic_dir(out_dir) as tmp:
        writers = {
            split: ShardWriter(tmp, split, image_size=params.image_size, shard_size=params.shard_size)
            for split in SPLITS
        }
        sizes = {(item.root, item.path): hashed.size for item, hashed in zip(candidates, hashes, strict=True)}
        files, quarantined, shapes = _decode_and_write(params, spec, roots, todo, sizes, writers, split_seed,
                                                       layout.fixed)  # fmt: skip
        resize["aspect_ratios"] = Aspect.of(shapes).to_json()  # of the accepted images, as decoded
        shards = {split: writer.close() for split, writer in writers.items()}
        quarantined.extend(todo.refused)
        quarantined.sort(key=lambda q: (q["root"], q["path"]))
        counts = {
            "seen": len(candidates) + len(ignored),
            "accepted": len(files),
            "quarantined": len(quarantined),
            "ignored": len(ignored),
        }
        if counts["seen"] != counts["accepted"] + counts["quarantined"] + counts["ignored"]:
            raise RuntimeError(f"preprocess accounting does not balance: {counts}")  # a bug, never bad data
        labels = {split: [f["label"] for f in files if f["split"] == split] for split in SPLITS}
        split_counts = {split: len(labels[split]) for split in SPLITS}
        check_usable(layout, files, split_counts, quarantined)
        manifest = _manifest(params, seed, spec, layout, counts, todo, split_counts, labels, shards, files, resize)
        (tmp / MANIFEST).write_text(dumps_json(manifest))
        report = {"quarantined": quarantined, "ignored": ignored, "duplicates": todo.duplicates, "counts": counts}
        (tmp / QUARANTINE).write_text(dumps_json(report))

    log_summary(quarantined, ignored, todo, counts, split_counts, class_names, out_dir)
    log.info("aspect ratios: %s", resize["aspect_ratios"]["summary"])
    log.info("resize %s (%s: %s)", resize["mode"], "auto" if resize["auto"] else "params.yaml", resize["why"])
    return PreprocessResult(counts, split_counts, class_names, Path(out_dir))


def _choose_resize(params: PreprocessParams, roots: Any, todo: Plan, centred: bool) -> dict[str, Any]:
    """preprocess.resize as written, or for `auto` the mode the images' aspect ratios call for (read from
    the headers of the files to decode, in worker processes: a header that crashes a worker costs nothing)."""
    if params.resize != "auto":
        return {"mode": params.resize, "auto": False, "why": "set in params.yaml"}
    if centred:
        return {
            "mode": "crop",
            "auto": True,
            "why": "the embedded default data draws every subject inside the "
            "central square, which a centre crop keeps whole and at full scale (and it cuts off distractors)",
        }
    items = [item for item, _ in todo.decode]
    probed = isolated_map(partial(probe_shape, roots), items, workers=params.workers, chunksize=64,
                          crashed=lambda item, detail: None, initializer=worker_init,
                          timeout_s=params.decode_timeout_s)  # fmt: skip
    measured = Aspect.of([shape for shape in _bar(probed, len(items), "measure aspect ratios") if shape])
    mode, why = choose_resize(measured)
    return {"mode": mode, "auto": True, "why": f"{why} (from the headers of {measured.count} files)"}


def _hash_same_size(workers: int, roots: Any, candidates: list[Candidate], hashes: list[Hashed]) -> None:
    """Pass 1: duplicates are known before anything is decoded or written. Only files of equal size
    (discovery stats every candidate) can have equal bytes, so only those are hashed here; every
    other file is read once, by the decode pass, which hashes the bytes it decodes. Threads
    suffice: reading and hashlib release the GIL, and hashing cannot crash on bad bytes."""
    same_size = Counter(h.size for h in hashes if not h.error and h.size > 0)
    shared = [i for i, h in enumerate(hashes) if not h.error and same_size[h.size] > 1]
    chunks = [shared[start : start + 128] for start in range(0, len(shared), 128)]
    with ThreadPoolExecutor(workers) as threads, _bar(None, len(shared), "hash same-size files") as bar:
        for chunk in threads.map(lambda chunk: [(i, hash_file(roots, candidates[i])) for i in chunk], chunks):
            for i, hashed in chunk:
                hashes[i] = hashed
            bar.update(len(chunk))


def _manifest(
    params: PreprocessParams, seed: int, spec: PreprocessSpec, layout: Layout, counts: dict[str, int],
    todo: Plan, split_counts: dict[str, int], labels: dict[str, list[int]], shards: dict[str, Any],
    files: list[dict[str, Any]], resize: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """manifest.json: format, spec (and why its resize), the folders' layout, split rule, counts, shards, the
    frozen test set and every accepted file."""
    class_names = spec.class_names
    test_hashes = sorted(f["sha256"] for f in files if f["split"] == "test")
    return {
        "format_version": FORMAT_VERSION,
        "image_size": params.image_size,
        "schema": schema_description(params.image_size),
        "class_names": list(class_names),
        "spec": spec.model_dump(mode="json"),
        "resize": resize,
        "layout": layout.to_json(),
        "split_rule": {
            "by": "sha256 of the file's bytes and the seed",
            "seed": seed,
            "val_fraction": 0.0 if "val" in layout.fixed else params.val_fraction,
            "test_fraction": 0.0 if "test" in layout.fixed else params.test_fraction,
            "val": _rule(layout, VAL_SOURCE),
            "test": _rule(layout, TEST_SOURCE),
        },
        "counts": counts,
        "duplicate_groups": len(todo.duplicates),
        "splits": {
            split: {
                "count": split_counts[split],
                "class_counts": class_counts(labels[split], len(class_names)),
                "shards": shards[split],
            }
            for split in SPLITS
        },
        "test_set": {
            "count": len(test_hashes),
            "sha256": image_set_sha256(test_hashes),  # the test set's one identity (tasks/images/image_set.py)
            "files": test_hashes,
        },
        "files": files,
    }


def _decode_and_write(
    params: PreprocessParams,
    spec: PreprocessSpec,
    roots: tuple[tuple[str, Path], ...],
    todo: Plan,
    sizes: dict[tuple[str, str], int],
    writers: dict[str, ShardWriter],
    split_seed: int,
    fixed: frozenset[str],
) -> tuple[list[dict[str, Any]], list[dict[str, str]], list[tuple[int, int]]]:
    """Pass 2: decode one copy of each distinct content in workers, stream accepted ones to shards.

    A file that pass 1 hashed must still have those bytes; one it only sized must still have that size."""
    config = CheckConfig(roots, spec, params.max_pixels, params.min_side)
    results = isolated_map(
        partial(check_file, config), [item for item, _ in todo.decode], workers=params.workers,
        crashed=lambda item, detail: Checked("", None, "worker_crash", detail), initializer=worker_init,
        timeout_s=params.decode_timeout_s,
    )  # fmt: skip
    files: list[dict[str, Any]] = []
    quarantined: list[dict[str, str]] = []
    shapes: list[tuple[int, int]] = []
    index: Counter[str] = Counter()
    for (item, digest), checked in zip(todo.decode, _bar(results, len(todo.decode), "decode"), strict=True):
        copies = todo.copies.get(digest, [])
        name = f"{item.root}:{item.path}"
        if checked.array is None:
            quarantined.append({**item.where(), "reason": checked.reason, "detail": checked.detail})
            quarantined.extend(
                {**c.where(), "reason": checked.reason, "detail": f"same bytes as {name}: {checked.detail}"}
                for c in copies
            )
            continue
        changed = checked.digest != digest if digest else checked.size != sizes[item.root, item.path]
        if changed:
            raise StageError(f"{dict(roots)[item.root] / item.path}: changed while preprocessing ran; run it again")
        digest = digest or checked.digest
        if item.root in FIXED_SPLIT:
            split = FIXED_SPLIT[item.root]
        else:
            split = split_of(digest, split_seed, params.val_fraction, params.test_fraction, fixed=fixed)
        writers[split].add(checked.array, item.label)
        shapes.append(checked.shape)
        files.append({**item.where(), "label": item.label, "sha256": digest, "split": split, "index": index[split]})
        index[split] += 1
        quarantined.extend(
            {**c.where(), "reason": "duplicate", "detail": f"same bytes as {name}, which is kept"} for c in copies
        )
    return files, quarantined, shapes


FIXED_SPLIT = {VAL_SOURCE: "val", TEST_SOURCE: "test"}


def _rule(layout: Layout, role: str) -> str:
    folder = layout.folder(role)
    if folder is None:
        return "hash range"
    return "data.test_source" if layout.kind == "class folders" else f"folder {folder.name}"


def _main(p: Params) -> None:
    check_data_folders(p.data, p.paths.generated)
    run(p.preprocess, seed=p.seed, source=p.data.source, out_dir=p.paths.shards,
        test_source=fixed_test_folder(p.data, p.paths.generated),
        centred=Path(p.data.source).resolve() == Path(p.paths.generated).resolve())  # fmt: skip


def main() -> None:
    stage_main("preprocess", _main)


if __name__ == "__main__":
    main()
