"""Stage preprocess: data.source [+ data.test_source] -> paths.shards: Arrow shards, manifest, quarantine.

Files are hashed, then decoded in worker processes; bad ones are quarantined with a reason, non-images ignored
(seen == accepted + quarantined + ignored); a file's split is a function of its bytes and the seed. An image that
the previous shards (or a killed run's) hold with the same preprocessing is not decoded again, and shards are laid
out by the dataset's growth (tasks/images/shard_layout.py), so a merge of new images writes new shards only.
"""

from __future__ import annotations

import logging
import shutil
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
from tasks.core.params import Params, PreprocessParams
from tasks.images.aspect import Aspect, choose_resize
from tasks.images.history import generations
from tasks.images.imaging import PreprocessSpec
from tasks.images.layout import Layout, check_data_folders, read_layout
from tasks.images.manifest_content import manifest_of
from tasks.images.report import check_usable, log_summary
from tasks.images.reuse import Pool, gather, pixels_key, salvage
from tasks.images.shard_build import ShardBuilder
from tasks.images.shards import MANIFEST, QUARANTINE, SPLITS
from tasks.images.space import check_space
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
    _hash_all(params.workers, roots, candidates, hashes)
    todo = plan(candidates, hashes, class_names)
    pool = gather(Path(out_dir), salvaged := salvage(Path(out_dir)))
    resize = _choose_resize(params, roots, todo, centred, pool.shapes)
    spec = PreprocessSpec(
        image_size=params.image_size,
        resize=resize["mode"],
        interpolation=params.interpolation,
        mean=params.mean,
        std=params.std,
        class_names=class_names,
        decode=params.decode,
    )
    order = _order(params, seed, todo, layout.fixed, generations(Path(source))[0])
    key = pixels_key(spec, {"max_pixels": params.max_pixels, "min_side": params.min_side})
    pool.select(key, params.image_size, {digest for _, digest, _, _ in order}, threads=params.workers)
    check_space(Path(out_dir), order, pool, params.image_size, params.shard_size)
    with atomic_dir(out_dir, keep_on_error=True) as tmp:  # a failed run's closed shards: the rerun reuses them
        builder = ShardBuilder(tmp, pool, image_size=params.image_size, shard_size=params.shard_size)
        try:
            files, quarantined, shapes = _decode_and_write(params, spec, roots, todo, order, pool, builder)
            shards = builder.finish()
        except BaseException:
            builder.abandon()
            raise
        resize["aspect_ratios"] = Aspect.of(shapes).to_json()  # of the accepted images, as their files declare
        quarantined.extend(todo.refused)
        quarantined.sort(key=lambda q: (q["root"], q["path"]))
        files.sort(key=lambda f: (f["root"], f["path"]))
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
        manifest = manifest_of(params, seed, spec, layout, counts, todo, split_counts, labels, shards, files, resize)
        manifest["pixels_key"] = key
        (tmp / MANIFEST).write_text(dumps_json(manifest))
        report = {"quarantined": quarantined, "ignored": ignored, "duplicates": todo.duplicates, "counts": counts}
        (tmp / QUARANTINE).write_text(dumps_json(report))
    if salvaged is not None:
        shutil.rmtree(salvaged, ignore_errors=True)
    _log_reuse(builder.stats)
    log_summary(quarantined, ignored, todo, counts, split_counts, class_names, out_dir)
    log.info("aspect ratios: %s", resize["aspect_ratios"]["summary"])
    log.info("resize %s (%s: %s)", resize["mode"], "auto" if resize["auto"] else "params.yaml", resize["why"])
    return PreprocessResult(counts, split_counts, class_names, Path(out_dir))


def _choose_resize(
    params: PreprocessParams, roots: Any, todo: Plan, centred: bool, known: dict[str, tuple[int, int]]
) -> dict[str, Any]:
    """preprocess.resize as written, or for `auto` the mode the images' aspect ratios call for (read from
    the headers of the files to decode, in worker processes: a header that crashes a worker costs nothing;
    `known`: the shapes earlier shards recorded for these bytes, as their headers declare them)."""
    if params.resize != "auto":
        return {"mode": params.resize, "auto": False, "why": "set in params.yaml"}
    if centred:
        return {
            "mode": "crop",
            "auto": True,
            "why": "the embedded default data draws every subject inside the "
            "central square, which a centre crop keeps whole and at full scale (and it cuts off distractors)",
        }
    items = [item for item, digest in todo.decode if digest not in known]
    probed = isolated_map(partial(probe_shape, roots), items, workers=params.workers, chunksize=64,
                          crashed=lambda item, detail: None, initializer=worker_init,
                          timeout_s=params.decode_timeout_s)  # fmt: skip
    shapes = [known[digest] for _, digest in todo.decode if digest in known]
    measured = Aspect.of(shapes + [shape for shape in _bar(probed, len(items), "measure aspect ratios") if shape])
    mode, why = choose_resize(measured)
    return {"mode": mode, "auto": True, "why": f"{why} (from the headers of {measured.count} files)"}


def _hash_all(workers: int, roots: Any, candidates: list[Candidate], hashes: list[Hashed]) -> None:
    """Pass 1: every file's sha256 before anything is decoded: it decides the file's split, its place in the
    shards and whether an earlier run decoded it already, and duplicates are known before anything is written
    (the decode pass hashes the bytes it decodes again: a file that changed in between is refused). Threads
    suffice: reading and hashlib release the GIL, and hashing cannot crash on bad bytes."""
    todo = [i for i, h in enumerate(hashes) if not h.error and h.size > 0]
    chunks = [todo[start : start + 128] for start in range(0, len(todo), 128)]
    with ThreadPoolExecutor(workers) as threads, _bar(None, len(todo), "hash files") as bar:
        for chunk in threads.map(lambda chunk: [(i, hash_file(roots, candidates[i])) for i in chunk], chunks):
            for i, hashed in chunk:
                hashes[i] = hashed
            bar.update(len(chunk))


Placed = tuple[Candidate, str, str, int]  # (representative, sha256, split, generation), in the shards' order:
# by split, generation, then path (a split's rows in its folders' order, as the manifest lists its files)


def _order(params: PreprocessParams, seed: int, todo: Plan, fixed: frozenset[str], history: dict[str, int]
           ) -> list[Placed]:  # fmt: skip
    placed = []
    for item, digest in todo.decode:
        if item.root in FIXED_SPLIT:
            split = FIXED_SPLIT[item.root]
        else:
            split = split_of(digest, seed, params.val_fraction, params.test_fraction, fixed=fixed)
        placed.append((item, digest, split, history.get(digest, 0)))
    placed.sort(key=lambda p: (SPLITS.index(p[2]), p[3], p[0].root, p[0].path))
    return placed


def _log_reuse(stats: dict[str, int]) -> None:
    log.info("images: %d decoded, %d copied from earlier shards, %d in %d earlier shard file(s) linked as they "
             "were; %d shard file(s) written", stats["decoded"], stats["copied"], stats["linked"],
             stats["linked_shards"], stats["written_shards"])  # fmt: skip


def _decode_and_write(
    params: PreprocessParams, spec: PreprocessSpec, roots: tuple[tuple[str, Path], ...], todo: Plan,
    order: list[Placed], pool: Pool, builder: ShardBuilder,
) -> tuple[list[dict[str, Any]], list[dict[str, str]], list[tuple[int, int]]]:  # fmt: skip
    """Pass 2: in the shards' order, each distinct content from the pool or decoded in workers, streamed to shards.

    A file must still have the bytes pass 1 hashed."""
    config = CheckConfig(roots, spec, params.max_pixels, params.min_side)
    results = iter(isolated_map(
        partial(check_file, config), [item for item, digest, _, _ in order if not pool.has(digest)],
        workers=params.workers, crashed=lambda item, detail: Checked("", None, "worker_crash", detail),
        initializer=worker_init, timeout_s=params.decode_timeout_s,
    ))  # fmt: skip
    files: list[dict[str, Any]] = []
    quarantined: list[dict[str, str]] = []
    shapes: list[tuple[int, int]] = []
    index: Counter[str] = Counter()
    for item, digest, split, generation in _bar(order, len(order), "decode"):
        copies = todo.copies.get(digest, [])
        name = f"{item.root}:{item.path}"
        if pool.has(digest):
            shape, pixels = pool.shapes[digest], None  # the pool's row, read only where a shard is written
        else:
            checked = next(results)
            if checked.array is None:
                quarantined.append({**item.where(), "reason": checked.reason, "detail": checked.detail})
                quarantined.extend(
                    {**c.where(), "reason": checked.reason, "detail": f"same bytes as {name}: {checked.detail}"}
                    for c in copies
                )
                continue
            if checked.digest != digest:
                raise StageError(f"{dict(roots)[item.root] / item.path}: changed while preprocessing ran; run it again")
            shape, pixels = checked.shape, checked.array
        builder.add(split, generation, digest, item.label, shape, pixels)
        shapes.append(shape)
        files.append({**item.where(), "label": item.label, "sha256": digest, "split": split, "index": index[split],
                      "shape": list(shape)})  # fmt: skip
        index[split] += 1
        quarantined.extend(
            {**c.where(), "reason": "duplicate", "detail": f"same bytes as {name}, which is kept"} for c in copies
        )
    return files, quarantined, shapes


FIXED_SPLIT = {VAL_SOURCE: "val", TEST_SOURCE: "test"}


def _main(p: Params) -> None:
    check_data_folders(p.data, p.paths.generated)
    run(p.preprocess, seed=p.seed, source=p.data.source, out_dir=p.paths.shards,
        test_source=fixed_test_folder(p.data, p.paths.generated),
        centred=Path(p.data.source).resolve() == Path(p.paths.generated).resolve())  # fmt: skip


def main() -> None:
    stage_main("preprocess", _main)


if __name__ == "__main__":
    main()
