"""pydantic's validation errors -> one line per key, as a params.yaml user reads them."""

from __future__ import annotations

import difflib

from pydantic import BaseModel, ValidationError

_UNION_TAGS = {"int", "float", "str", "bool", "none"}  # pydantic's names for the members of a union in an error loc


def _known_keys(root: type[BaseModel], loc: tuple[object, ...]) -> list[str]:
    """The keys params.yaml may hold at the level of `loc` (a key path ending in the unknown key)."""
    model: type[BaseModel] = root
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field is not None else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _key_path(loc: tuple[object, ...]) -> tuple[object, ...]:
    """The params.yaml keys of an error location, without pydantic's union-member tags
    (`train.lr.constrained-float` -> `train.lr`)."""
    return tuple(p for p in loc if not isinstance(p, str) or (p.isidentifier() and p not in _UNION_TAGS))


def _describe(root: type[BaseModel], error: dict) -> str:
    key = ".".join(str(part) for part in error["loc"]) or "<top level>"
    if error["type"] == "extra_forbidden":
        close = difflib.get_close_matches(str(error["loc"][-1]), _known_keys(root, error["loc"]), n=1, cutoff=0.6)
        prefix = key.rsplit(".", 1)[0] + "." if "." in key else ""
        return f"{key}: unknown key" + (f"; did you mean {prefix}{close[0]}?" if close else "")
    return f"{key}: {error['msg']} (got {error.get('input')!r})"


def describe_errors(exc: ValidationError, root: type[BaseModel]) -> list[str]:
    """One line per offending key of `root`'s data: `train.epoch: unknown key; did you mean train.epochs?`."""
    # A value refused by every member of `number | "auto"` is one line: "... greater than 0, or 'auto'".
    merged: dict[tuple[object, ...], dict] = {}
    for err in sorted(exc.errors(), key=lambda e: e["type"] == "literal_error"):
        loc = _key_path(err["loc"])
        if loc in merged:
            merged[loc]["msg"] += ", or " + err["msg"].removeprefix("Input should be ")
        else:
            merged[loc] = {**err, "loc": loc}
    return [_describe(root, err) for err in merged.values()]
