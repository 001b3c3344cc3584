"""The one error type a stage turns into a readable message and exit status 2 (no traceback)."""

from __future__ import annotations


class StageError(RuntimeError):
    """A failure the user can act on; printed without a traceback."""
