"""Images decoded before with the same preprocessing -> rows to copy and whole shard files to link, not decode.

Two places hold them: the previous shard directory (DVC keeps paths.shards in place while the stage runs:
`persist: true` in dvc.yaml) and the complete shards of a run that was killed (its temporary folder, whose
PROGRESS file lists each shard as it closes). A shard is used only when its pixels were made by the same
`pixels_key` (format, spec less the class names, decoder versions) and its bytes match the sha256 recorded for
it; anything else is decoded again. The declared shape of every image any of them lists is kept whatever its
key: it is the file's, not the spec's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tasks.core.io import dead_writers_temps, dumps_json, sha256_bytes, sha256_file
from tasks.images.imaging import PreprocessSpec
from tasks.images.shards import FORMAT_VERSION, MANIFEST, SPLITS, ShardError, load_manifest

log = logging.getLogger(__name__)
PROGRESS = ".progress.jsonl"  # in a run's temporary folder: one line per shard closed; removed before commit


def decoder_versions() -> dict[str, str]:
    """The libraries whose output is in a row's bytes: Pillow and the JPEG library it decodes with."""
    import PIL
    from PIL import features

    return {"pillow": PIL.__version__, "libjpeg": str(features.version("jpg"))}


def pixels_key(spec: PreprocessSpec, accept: dict[str, int]) -> str:
    """What decides a row's bytes besides the file's, and whether the file is accepted at all (`accept`: the
    limits preprocess checks, max_pixels and min_side): shards of one key hold the same row for the same file."""
    recipe = spec.model_dump(mode="json", exclude={"class_names"})
    found = {"format": FORMAT_VERSION, "spec": recipe, "decoder": decoder_versions(), "accept": accept}
    return sha256_bytes(dumps_json(found).encode())


@dataclass
class PoolShard:
    path: Path
    sha256: str
    images: tuple[str, ...]
    labels: tuple[int, ...]
    image_size: int
    blocks: list[np.ndarray] | None = None  # memory-mapped once verified
    offsets: np.ndarray | None = None

    def verify(self) -> bool:
        """Are its bytes the ones recorded for it?"""
        return sha256_file(self.path) == self.sha256

    def row(self, k: int) -> np.ndarray:
        """Row k, a view into the memory-mapped file (mapped on first use)."""
        if self.blocks is None:
            import pyarrow as pa

            reader = pa.ipc.open_file(pa.memory_map(str(self.path), "r"))
            size = self.image_size
            self.blocks = [reader.get_batch(i).column(0).flatten().to_numpy(zero_copy_only=True)
                           .reshape(-1, 3, size, size) for i in range(reader.num_record_batches)]  # fmt: skip
            self.offsets = np.cumsum([0, *(len(b) for b in self.blocks)])
        assert self.offsets is not None
        block = int(np.searchsorted(self.offsets, k, side="right")) - 1
        return self.blocks[block][k - self.offsets[block]]


@dataclass
class Pool:
    """Every shard found, by its pixels key; `select(key)` makes the rows of that key usable."""

    candidates: list[tuple[str, PoolShard]] = field(default_factory=list)  # (pixels key, shard)
    shapes: dict[str, tuple[int, int]] = field(default_factory=dict)  # image sha256 -> declared (width, height)
    key: str = ""
    shards: list[PoolShard] = field(default_factory=list)
    rows: dict[str, tuple[int, int]] = field(default_factory=dict)  # image sha256 -> (shard, row)
    whole: dict[str, int] = field(default_factory=dict)  # members digest -> shard

    def select(self, key: str, image_size: int, needed: set[str], *, threads: int = 2) -> None:
        """Use the shards of `key` that hold any of the `needed` images and match their checksums (read in
        `threads`: hashlib releases the GIL)."""
        from concurrent.futures import ThreadPoolExecutor

        self.key = key
        usable = [
            shard for shard_key, shard in self.candidates if shard_key == key and needed.intersection(shard.images)
        ]

        def verified(shard: PoolShard) -> bool:
            try:
                if shard.verify():
                    return True
                why = "its checksum does not match its record"
            except OSError as exc:
                why = exc.strerror or str(exc)
            log.warning("%s: not reused (%s); its images are decoded again", shard.path, why)
            return False

        with ThreadPoolExecutor(threads) as pool:
            checks = list(pool.map(verified, usable))
        for shard, ok in zip(usable, checks, strict=True):
            if not ok:
                continue
            shard.image_size = image_size
            index = len(self.shards)
            self.shards.append(shard)
            for row, digest in enumerate(shard.images):
                self.rows.setdefault(digest, (index, row))
            self.whole.setdefault(members_digest(shard.images, shard.labels), index)

    def has(self, digest: str) -> bool:
        return digest in self.rows

    def row(self, digest: str) -> np.ndarray:
        index, row = self.rows[digest]
        return self.shards[index].row(row)

    def shard_like(self, images: list[str], labels: list[int]) -> PoolShard | None:
        """A verified shard holding exactly these images with these labels, in this order (the bytes writing them
        would give), or None."""
        index = self.whole.get(members_digest(images, labels))
        return None if index is None else self.shards[index]


def members_digest(images: tuple[str, ...] | list[str], labels: tuple[int, ...] | list[int]) -> str:
    return sha256_bytes(json.dumps([list(images), list(labels)]).encode())


def progress_line(entry: dict[str, Any], key: str, images: list[str], labels: list[int],
                  shapes: list[tuple[int, int]]) -> str:  # fmt: skip
    return json.dumps({**entry, "key": key, "images": images, "labels": labels, "shapes": shapes}) + "\n"


def salvage(out_dir: Path) -> Path | None:
    """Move the temporary folders of killed runs of this stage (`.<name>.tmp-<pid>`, and what an earlier rerun
    salvaged and did not finish) into one `.<name>.salvage-<our pid>` folder, away from atomic_dir's clean-up."""
    out_dir = Path(out_dir)
    found = [p for p in dead_writers_temps(out_dir, ("tmp", "salvage")) if p.is_dir() and not p.is_symlink()]
    if not found:
        return None
    target = out_dir.with_name(f".{out_dir.name}.salvage-{os.getpid()}")
    target.mkdir(exist_ok=True)
    for k, path in enumerate(found):
        path.rename(target / f"{k:03d}")
    return target


def _progress_shards(folder: Path) -> list[dict[str, Any]]:
    """The shards a killed run closed, from its PROGRESS lines (a last line cut short by the kill is skipped)."""
    found = []
    for progress in sorted(folder.rglob(PROGRESS)):
        for line in progress.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                entry = json.loads(line)
                entry["path"] = progress.parent / entry["file"]
                found.append(entry)
    return found


def gather(out_dir: Path, salvaged: Path | None) -> Pool:
    """Every shard of the previous shard directory and of killed runs, with the declared shape of each image they
    list (whatever its key: a shape is the file's)."""
    pool = Pool()
    manifest = _previous_manifest(Path(out_dir))
    if manifest is not None:
        for split in SPLITS:
            files = sorted((f for f in manifest["files"] if f["split"] == split), key=lambda f: f["index"])
            for f in files:
                pool.shapes.setdefault(f["sha256"], (int(f["shape"][0]), int(f["shape"][1])))
            start = 0
            for entry in manifest["splits"][split]["shards"]:
                members = files[start : start + entry["count"]]
                start += entry["count"]
                shard = PoolShard(Path(out_dir) / entry["file"], entry["sha256"], tuple(f["sha256"] for f in members),
                                  tuple(f["label"] for f in members), 0)  # fmt: skip
                pool.candidates.append((manifest.get("pixels_key", ""), shard))
    for entry in _progress_shards(salvaged) if salvaged is not None else ():
        for digest, shape in zip(entry["images"], entry["shapes"], strict=True):
            pool.shapes.setdefault(digest, (int(shape[0]), int(shape[1])))
        if entry["path"].is_file():
            shard = PoolShard(entry["path"], entry["sha256"], tuple(entry["images"]), tuple(entry["labels"]), 0)
            pool.candidates.append((entry["key"], shard))
    return pool


def _previous_manifest(out_dir: Path) -> dict[str, Any] | None:
    if not (out_dir / MANIFEST).is_file():
        return None
    try:
        manifest = load_manifest(out_dir)
    except (ShardError, ValueError, OSError):
        return None  # another format: nothing to reuse
    return manifest if all("shape" in f for f in manifest.get("files", [])) else None


def link_or_copy(src: Path, dst: Path) -> None:
    """The same bytes at `dst`: a hard link (no copy, and DVC finds the file's hash in its state by inode)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
