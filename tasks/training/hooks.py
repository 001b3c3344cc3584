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

`IMAGEPIPE_TRAIN_HOOKS=/path/to/module.py` loads the module's `make_hooks()` into the train stage
(`make sanity` takes none). Unset (the normal case), nothing is imported.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

ENV = "IMAGEPIPE_TRAIN_HOOKS"


class Hooks:
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


def hooks_from_env() -> Hooks:
    """The hooks that IMAGEPIPE_TRAIN_HOOKS names, or the no-op ones."""
    location = os.environ.get(ENV)
    if not location:
        return Hooks()
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
    return hooks
