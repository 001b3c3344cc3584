"""Where a drift window keeps its counts: this process's memory, or a block every worker of a server maps.

A window's state is a few arrays of 8-byte numbers (a Layout: name, typecode 'q' or 'd', length), read and
written through memoryviews, so the same code runs on a bytearray here and on a file mapped by several
processes (serving/shared_memory.py). A memory also gives the lock that guards the block: a thread lock here;
a thread lock and a file lock there. Pure stdlib: the torch-free serving venv imports it.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol

Layout = Sequence[tuple[str, str, int]]  # (name, typecode: 'q' int64 | 'd' float64, length)
CELL = 8  # bytes per number: both typecodes


def layout_size(layout: Layout) -> int:
    return CELL * sum(length for _, _, length in layout)


def fingerprint(layout: Layout) -> bytes:
    """8 bytes naming the layout: a block mapped with another layout (another model's classes) is refused."""
    return hashlib.sha256(repr([tuple(part) for part in layout]).encode()).digest()[:CELL]


def views(buffer: memoryview, layout: Layout) -> dict[str, memoryview]:
    """The layout's arrays over `buffer`, in order from its start."""
    out, offset = {}, 0
    for name, code, length in layout:
        out[name] = buffer[offset : offset + CELL * length].cast(code)
        offset += CELL * length
    return out


class WindowMemory(Protocol):
    def open(self, layout: Layout) -> dict[str, memoryview]:
        """The layout's arrays, zeroed when new (a zeroed block is an empty window)."""
        ...

    def lock(self) -> AbstractContextManager[object]:
        """Held around every read and write of the arrays."""
        ...

    def close(self) -> None:
        """Give back what `open` took (a mapping, a descriptor); the arrays are not used after."""
        ...


class LocalMemory:
    """This process's memory and a thread lock: one worker, the tests, the benches."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def open(self, layout: Layout) -> dict[str, memoryview]:
        return views(memoryview(bytearray(layout_size(layout))), layout)

    def lock(self) -> AbstractContextManager[object]:
        return self._lock

    def close(self) -> None:
        """Nothing to give back: the arrays are this process's."""
