"""The search space of params.yaml's `sweep.space`, checked against params.yaml before any trial runs.

A key must name a value params.yaml has (dotted, as `dvc exp run -S` and `dvc exp show` name it), and each end
of its range (or each choice) must be a value that key takes: params.yaml with the value set must still pass
tasks/core/params.py. So `train.lr: {low: a, high: b}` is fine, `train.optimizer: {low: 0, high: 1}` is refused
in one line, as is a float range on an integer key.
"""

from __future__ import annotations

import copy
from typing import Any

import optuna

from tasks.core.experiment_params import SearchRange
from tasks.core.nested import flatten
from tasks.core.params import ParamsError, parse_params


class SpaceError(ValueError):
    """The search space names a key params.yaml lacks, or a range the key does not take: one line."""


def _with(raw: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    tree = copy.deepcopy(raw)
    node = tree
    *parents, leaf = key.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = value
    return tree


def _ends(spec: SearchRange) -> list[Any]:
    if spec.choices is not None:
        return list(spec.choices)
    if spec.integer:
        return [int(spec.low), int(spec.high)]  # type: ignore[arg-type]
    return [float(spec.low), float(spec.high)]  # type: ignore[arg-type]


def check_space(raw: dict[str, Any], space: dict[str, SearchRange]) -> None:
    """Raise SpaceError, naming the key and the value, unless every searched key exists and takes its range."""
    if not space:
        raise SpaceError("params.yaml sweep.space is empty: name at least one key to search, e.g. train.lr")
    known = flatten(raw)
    for key, spec in space.items():
        if key.startswith("sweep.") or key.startswith("tracking."):
            raise SpaceError(f"sweep.space.{key}: the sweep's own settings are not hyperparameters")
        if key not in known:
            raise SpaceError(f"sweep.space.{key}: params.yaml has no key {key} (dotted, as `dvc exp run -S` names it)")
        current = known[key]
        if isinstance(current, (dict, list)):
            raise SpaceError(f"sweep.space.{key}: {key} is a section in params.yaml, not a value")
        for value in _ends(spec):
            try:
                parse_params(_with(raw, key, value))
            except ParamsError as exc:
                why = str(exc).splitlines()[-1].strip()
                kind = "choice" if spec.choices is not None else "integer range" if spec.integer else "range"
                raise SpaceError(
                    f"sweep.space.{key}: {key}={value!r} from its {kind} is not a value {key} takes ({why})"
                ) from None
        if key == "train.arch":
            _check_models(spec)


def _check_models(spec: SearchRange) -> None:
    """Each arch choice names a model (torchvision's or timm's): the schema checks only its spelling."""
    from tasks.training.models import ModelError, check_arch  # torch and torchvision: only for a sweep over models

    for value in _ends(spec):
        try:
            check_arch(str(value))
        except ModelError as exc:
            raise SpaceError(f"sweep.space.train.arch: {value!r} from its choice is not a model ({exc})") from None


def suggest(trial: optuna.trial.BaseTrial, space: dict[str, SearchRange]) -> dict[str, Any]:
    """The trial's values, one per searched key."""
    values: dict[str, Any] = {}
    for key, spec in space.items():
        if spec.choices is not None:
            values[key] = trial.suggest_categorical(key, list(spec.choices))
        elif spec.integer:
            values[key] = trial.suggest_int(key, int(spec.low), int(spec.high), log=spec.log)  # type: ignore[arg-type]
        else:
            values[key] = trial.suggest_float(key, float(spec.low), float(spec.high), log=spec.log)  # type: ignore[arg-type]
    return values


def set_args(values: dict[str, Any]) -> list[str]:
    """`-S key=value` for each value, as `dvc exp run` takes them."""
    args: list[str] = []
    for key, value in values.items():
        text = str(value).lower() if isinstance(value, bool) else repr(value) if isinstance(value, float) else value
        args += ["-S", f"{key}={text}"]
    return args
