"""Fixtures the review tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.review import tracked_project


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A real DVC-tracked dataset: data/raw/pets (class_0..2, 4 images each), committed; data.source points at it."""
    return tracked_project(tmp_path)
