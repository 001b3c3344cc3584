"""The review folder of low-confidence inputs, bounded across the server's workers.

Inputs under the confidence threshold -> `<review_dir>/<predicted class>/<sha256>.<ext>` + a `.json` sidecar,
an ImageFolder that `data.source` can take in once a person has moved each image to its true class
(tasks/images/review_folder.py says what counts as an image there, for the server, the page and the take-in).
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

from PIL import Image

from tasks.core.io import atomic_file
from tasks.images import review_folder
from tasks.images.imaging import IMAGE_SUFFIXES
from tasks.release.window_memory import LocalMemory, WindowMemory


def image_suffix(data: bytes) -> str | None:
    """The suffix preprocess recognises for these bytes' format (header only), or None."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            fmt = (img.format or "").lower()
    except Exception:  # untrusted bytes: any failure means "not saveable"
        return None
    suffix = {"jpeg": ".jpg", "tiff": ".tif", "mpo": ".jpg"}.get(fmt, f".{fmt}")
    return suffix if suffix in IMAGE_SUFFIXES else None


class ReviewFolder:
    """Bounded store of low-confidence inputs: at most `max_files` images of at most `max_file_bytes` each. Once
    the app starts, the count lives in a block every worker of the server maps (serving/shared_memory.py), so
    the bound is the server's, not each worker's. A save the count calls full counts the folder again first:
    images taken in, discarded or deleted while the server runs make room without a restart."""

    def __init__(self, root: Path, max_files: int, max_file_bytes: int) -> None:
        self.root, self.max_files, self.max_file_bytes = root, max_files, max_file_bytes
        self._full_folders: tuple[tuple[str, int], ...] | None = None  # the folders when a recount found it full
        self.share(LocalMemory())

    def share(self, memory: WindowMemory) -> None:
        """The count kept in `memory` from now on (the server's block, once the app starts), counted afresh."""
        self._cell = memory.open([("count", "q", 1)])["count"]
        self._lock = memory.lock()
        self.recount()

    @property
    def count(self) -> int:
        return self._cell[0]

    def recount(self) -> int:
        """The images in the folder now: `make add-data SRC=<review folder> INTO=...` takes them out while the
        server runs, and a person may delete some."""
        with self._lock:
            self._cell[0] = self._images()
            return self._cell[0]

    def _images(self) -> int:
        """Images still to review, as the page and the take-in read them (tasks/images/review_folder.py)."""
        return review_folder.count(self.root)

    def _folders(self) -> tuple[tuple[str, int], ...]:
        """The folder and its class folders with their mtimes: an image moved out or deleted changes one."""
        try:
            entries = [self.root, *(p for p in self.root.iterdir() if p.is_dir())]
            return tuple((p.name, p.stat().st_mtime_ns) for p in entries)
        except OSError:
            return ()

    def save(self, data: bytes, sha256: str, label: str, record: dict[str, Any]) -> str | None:
        """Write the image and its sidecar (temp + rename); returns why not when it was skipped."""
        if len(data) > self.max_file_bytes:
            return "too_large"
        suffix = image_suffix(data)
        if suffix is None:
            return "unknown_format"
        folder = self.root / label
        target = folder / f"{sha256}{suffix}"
        with self._lock:
            if target.exists():
                return "duplicate"
            if self._cell[0] >= self.max_files and self._folders() != self._full_folders:
                # Full by the count: counted again, since a take-in, the page's discards or a person's deletes
                # lower it; while the folders stay as they were when it was last found full, not again (a flood
                # of uploads costs a stat per class folder, not a walk of the folder).
                self._cell[0] = self._images()
                self._full_folders = self._folders() if self._cell[0] >= self.max_files else None
            if self._cell[0] >= self.max_files:
                return "full"
            # Written under the lock: a recount (above, in another worker) then never misses a save the count
            # already holds, which would let the folder grow past max_files.
            folder.mkdir(parents=True, exist_ok=True)
            sidecar = target.with_suffix(".json")
            # Time belongs in the sidecar: the review folder is intake, not a versioned artifact.
            payload = {**record, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            for path, content in ((sidecar, json.dumps(payload, indent=2).encode()), (target, data)):
                with atomic_file(path, durable=False) as handle:  # the image last: an image always has its sidecar
                    handle.write(content)
            self._cell[0] += 1
        return None
