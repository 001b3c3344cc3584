"""Lifecycle hooks of the training loop: no-ops by default, for code that must watch or steer a run
from outside (the tests plant faults through them: tests/helpers/faults.py).

    on_fit_start(model)            once, before the first step, with the unwrapped model
    on_step_start(step)            before optimizer step `step` (1-based) loads its first micro-batch
    after_backward(step, model, loss_scale)
                                   after the last micro-batch's backward, before the gradients are checked
    before_checkpoint_commit(tmp, number)
                                   the `number`-th checkpoint of this process is written to `tmp`, not yet
                                   renamed into place
    after_checkpoint(path, number) ... and is on disk as `path`

Hooks are for tests only. `IMAGEPIPE_TRAIN_HOOKS=/path/to/module.py` loads the module's `make_hooks()`
into the train stage only together with `IMAGEPIPE_ALLOW_TEST_HOOKS=1`; otherwise the stage refuses to
start. A run with hooks says so in train_run.json (`test_hooks`: the file and its sha256) and in the
model's provenance, and make promote and make commit-run refuse that model. Unset (the normal case),
nothing is imported. `make sanity` takes none.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from tasks.core.environment import ALLOW_HOOKS_ENV, HOOKS_ENV
from tasks.core.errors import StageError
from tasks.core.io import sha256_file

ENV, ALLOW = HOOKS_ENV, ALLOW_HOOKS_ENV


class Hooks:
    origin: str | None = None  # what planted them, for the run record; None: the no-op default

    def on_fit_start(self, model: torch.nn.Module) -> None:
        pass

    def on_step_start(self, step: int) -> None:
        pass

    def after_backward(self, step: int, model: torch.nn.Module, loss_scale: float) -> None:
        pass

    def before_checkpoint_commit(self, tmp: Path, number: int) -> None:
        pass

    def after_checkpoint(self, path: Path, number: int) -> None:
        pass


def planted(hooks: Hooks) -> str | None:
    """What a run's record says about its hooks: None for the no-op ones, else where they came from."""
    if type(hooks) is Hooks:
        return None
    return hooks.origin or f"{type(hooks).__module__}.{type(hooks).__qualname__} (passed in by code)"


def hooks_from_env() -> Hooks:
    """The hooks that IMAGEPIPE_TRAIN_HOOKS names (only with IMAGEPIPE_ALLOW_TEST_HOOKS=1), or the no-op ones."""
    location = os.environ.get(ENV)
    if not location:
        return Hooks()
    if os.environ.get(ALLOW) != "1":
        raise StageError(
            f"{ENV}={location}: training hooks are for tests and are not loaded without {ALLOW}=1; unset {ENV} "
            "for a real run (a model trained with hooks is marked as such and is never promoted)"
        )
    path = Path(location)
    spec = importlib.util.spec_from_file_location(f"_train_hooks_{path.stem}", path)
    if not path.is_file() or spec is None or spec.loader is None:
        raise FileNotFoundError(f"{ENV}={location}: no such Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "make_hooks"):
        raise AttributeError(f"{ENV}={location}: the module has no make_hooks()")
    hooks = module.make_hooks()
    if not isinstance(hooks, Hooks):
        raise TypeError(f"{ENV}={location}: make_hooks() returned {type(hooks).__name__}, not a Hooks")
    hooks.origin = f"{path.resolve()} (sha256 {sha256_file(path)})"
    return hooks
