"""Checkpoints: training state -> `<checkpoints>/<run>/last.pt` and `best.pt`, and back.

One file per save: a temporary file in the same directory, fsynced, renamed over `last.pt`; a file
holding NaN/Inf is never written; loading uses weights_only=True and refuses a checkpoint made from
other params, data, code or environment (tasks/training/identity.py). Also: `train.init_from` weights.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tasks.core.errors import StageError
from tasks.core.io import atomic_file, fsync_dir, read_json, sha256_file, write_json
from tasks.training.hooks import Hooks
from tasks.training.identity import RunIdentity, identity_differences

log = logging.getLogger(__name__)

FORMAT = 3  # 2: the step runner's counters apart from the loop's position; 3: training dynamics
LAST, BEST = "last.pt", "best.pt"
IDENTITY = "identity.json"  # what the run's identity covers, so that another run can say why it differs


class CheckpointError(StageError):
    """A checkpoint that cannot be written or must not be loaded."""


def capture_rng(loader_state: torch.Tensor) -> dict[str, Any]:
    """Every RNG the loop draws from; numpy's state becomes a tensor so weights_only can load it."""
    key, keys, pos, has_gauss, cached = np.random.get_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {
        "python": random.getstate(),
        "numpy": [key, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
        "cuda": cuda,
        "loader": loader_state.clone(),
    }


def restore_rng(rng: dict[str, Any]) -> torch.Tensor:
    """Restore the global RNGs; returns the loader generator's state to set."""
    random.setstate(rng["python"])
    key, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((key, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return rng["loader"]


def _tensors(prefix: str, obj: Any) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensors(f"{prefix}.{key}", value)
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            yield from _tensors(f"{prefix}.{i}", value)


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    for name, tensor in named:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name
    return None


RUN_NAME = re.compile(r"[0-9a-f]{16}")  # RunIdentity.name


def prune_runs(checkpoint_dir: Path, *, keep: int, current: str) -> list[Path]:
    """Delete the checkpoint folders of all but the `keep` most recent runs (by the time of their
    newest checkpoint); the current run counts as one and is never deleted. Only folders named like
    a run that hold nothing but checkpoint files are touched. Returns the folders removed."""
    if keep <= 0 or not Path(checkpoint_dir).is_dir():
        return []
    runs = []
    for folder in Path(checkpoint_dir).iterdir():
        if folder.name == current or not folder.is_dir() or folder.is_symlink() or not RUN_NAME.fullmatch(folder.name):
            continue
        files = list(folder.iterdir())
        ours = (LAST, BEST, IDENTITY)
        if not files or not all(f.is_file() and (f.name in ours or f.name.startswith(".")) for f in files):
            continue  # not (only) ours: leave it
        runs.append((max(f.stat().st_mtime_ns for f in files), folder.name, folder))
    runs.sort(reverse=True)
    removed = [folder for _, _, folder in runs[keep - 1 :]]
    for folder in removed:
        shutil.rmtree(folder)
    return removed


class Checkpointer:
    """The checkpoint folder of one run. Only the main process writes; every process may read."""

    def __init__(self, directory: Path, identity: RunIdentity, hooks: Hooks | None = None) -> None:
        self.directory, self.identity, self.hooks = Path(directory), identity, hooks or Hooks()
        self.saves = 0

    @property
    def last(self) -> Path:
        return self.directory / LAST

    @property
    def best(self) -> Path:
        return self.directory / BEST

    def discard(self) -> None:
        """Start fresh (train.resume: false): the old checkpoints go."""
        for path in (self.last, self.best):
            path.unlink(missing_ok=True)

    def other_run(self) -> str | None:
        """Why this run starts from step 0 although checkpoints are there: the newest other run's folder
        and what differs from it (code, environment, params, data), or None when there is no other run."""
        parent = self.directory.parent
        found = parent.iterdir() if parent.is_dir() else ()
        others = [f for f in found if f != self.directory and (f / LAST).is_file()]
        if not others:
            return None
        newest = max(others, key=lambda f: (f / LAST).stat().st_mtime_ns)
        try:
            theirs = read_json(newest / IDENTITY)["parts"]
        except (OSError, ValueError, KeyError, TypeError):
            return f"{newest / LAST} is of another run (written before runs recorded their identity)"
        differ = identity_differences(self.identity.parts, theirs)
        shown = ", ".join(differ[:6]) + (f" and {len(differ) - 6} more" if len(differ) > 6 else "")
        return f"{newest / LAST} is of another run: {shown or 'its identity'} changed"

    def remove_partial_writes(self) -> None:
        """Temporary files of a save that was killed: never loaded, removed before the next save."""
        for path in self.directory.glob(".*.tmp-*"):
            path.unlink(missing_ok=True)

    def load(self, path: Path | None = None) -> dict[str, Any] | None:
        path = path or self.last
        if not path.is_file():
            return None
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # a torn or foreign file: say so rather than train from it
            raise CheckpointError(
                f"{path}: cannot be loaded ({type(exc).__name__}: {str(exc)[:200]}); delete it or set "
                "train.resume: false to start fresh"
            ) from None
        if not isinstance(payload, dict) or "format" not in payload:
            raise CheckpointError(f"{path}: not a checkpoint of this pipeline; delete it or set train.resume: false")
        if payload["format"] != FORMAT:
            # Written by another version of this code (say, before an upgrade): it cannot be resumed,
            # and refusing would stop every rerun of the stage. Start fresh; it is replaced at the first save.
            log.warning("%s: a checkpoint of format %s, this code reads format %s; starting this run fresh",
                        path, payload["format"], FORMAT)  # fmt: skip
            return None
        mine = self.identity.hashes()
        theirs = {key: payload.get(f"{key}_sha256", "") for key in mine}
        differ = [key for key in mine if theirs[key] != mine[key]]
        if differ:
            shown = ", ".join(f"{key} {theirs[key][:12] or '(none)'} vs {mine[key][:12] or '(none)'}" for key in differ)
            raise CheckpointError(
                f"{path}: made from other {' and '.join(differ)} than this run ({shown}); refusing to resume "
                "from it. Set train.resume: false to start fresh (the checkpoint is then replaced)."
            )
        return payload

    def save(self, payload: dict[str, Any], *, is_best: bool) -> Path:
        """Write `last.pt` atomically (and `best.pt` when `is_best`); refuses NaN/Inf anywhere in it."""
        bad = first_nonfinite(_tensors("model", payload["model"])) or first_nonfinite(
            _tensors("optimizer", payload["optimizer"])
        )
        if bad is not None:
            raise CheckpointError(
                f"refusing to write a checkpoint: {bad} holds NaN/Inf; {self.last} is the last good one"
            )
        payload = {"format": FORMAT, **payload}
        payload.update({f"{key}_sha256": value for key, value in self.identity.hashes().items()})
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.identity.parts and not (self.directory / IDENTITY).is_file():
            write_json(self.directory / IDENTITY, {**self.identity.hashes(), "parts": self.identity.parts})
        self.remove_partial_writes()
        self.saves += 1
        saves = self.saves
        with atomic_file(
            self.last, before_commit=lambda tmp: self.hooks.before_checkpoint_commit(tmp, saves)
        ) as handle:
            torch.save(payload, handle)
        if is_best:
            tmp_best = self.directory / f".{BEST}.tmp-{os.getpid()}"
            try:
                os.link(self.last, tmp_best)  # same bytes, no second write
            except OSError:
                shutil.copyfile(self.last, tmp_best)
            os.replace(tmp_best, self.best)
        fsync_dir(self.directory)
        self.hooks.after_checkpoint(self.last, self.saves)
        return self.last


def _strip(key: str) -> str:
    for prefix in ("module.", "_orig_mod."):
        while key.startswith(prefix):
            key = key[len(prefix) :]
    return key


def read_state(path: Path) -> Any:
    """A weights file: safetensors (the Hugging Face hub's format) by its suffix, else torch's, tensors only."""
    if Path(path).suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(path, device="cpu")
    return torch.load(path, map_location="cpu", weights_only=True)


def load_init_weights(model: torch.nn.Module, path: Path, what: str = "train.init_from") -> dict[str, Any]:
    """Transfer learning: copy every layer of `path` whose name and shape match; list what was skipped."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{what}: {path} does not exist")
    try:
        payload = read_state(path)
    except Exception as exc:
        raise CheckpointError(
            f"{what}: {path} is not a weights file torch loads with weights_only=True ({type(exc).__name__})"
        ) from None
    state = payload
    if isinstance(payload, dict):
        state = payload.get("state_dict", payload.get("model", payload))  # model.pt, checkpoint, or bare
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{what}: {path} holds no state dict (model.pt, a checkpoint, or name->tensor)")
    own = model.state_dict()
    matched, skipped = {}, []
    for key, tensor in ((_strip(k), v) for k, v in state.items()):
        if key not in own:
            skipped.append({"name": key, "reason": "not in this model"})
        elif tuple(tensor.shape) != tuple(own[key].shape):
            shapes = f"shape {list(tensor.shape)} in the file, {list(own[key].shape)} in the model"
            skipped.append({"name": key, "reason": shapes})
        else:
            matched[key] = tensor
    if not matched:
        raise CheckpointError(f"{what}: no layer of {path} matches this model (wrong arch?)")
    model.load_state_dict(matched, strict=False)
    fresh = [key for key in own if key not in matched]
    for item in skipped:
        log.warning("%s: skipped %s (%s)", what, item["name"], item["reason"])
    log.info("%s %s: %d tensors loaded, %d skipped, %d left at initialisation", what, path, len(matched),
             len(skipped), len(fresh))  # fmt: skip
    return {"path": str(path), "sha256": sha256_file(path), "loaded": len(matched), "skipped": skipped, "fresh": fresh}
