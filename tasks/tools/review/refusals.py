"""The review page's refusals: a StageError with the HTTP status the page answers it with (one line each)."""

from __future__ import annotations

from tasks.core.errors import StageError


class Refusal(StageError):
    """The folder, the dataset or DVC is not in a state that allows this (409), nothing was changed."""

    status = 409


class BadInput(Refusal):
    """A request the page cannot act on as typed (400)."""

    status = 400


class Gone(Refusal):
    """The image (or the dataset file) is no longer there (410): taken in or moved meanwhile."""

    status = 410


class NotFound(Refusal):
    """No such file to serve, or a path outside the folders the page serves (404)."""

    status = 404
