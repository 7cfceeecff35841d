"""The fields precisionlab reads back from a run directory, checked when each file is read.

A run directory is data on disk that anyone may have edited, truncated or replaced: every
file of it is read through :func:`read_json` / :func:`read_jsonl` (regular files only, size
limits: :mod:`precisionlab._io`), then checked against the schema of its name here, so a
damaged file is one :class:`~precisionlab._io.DamagedFileError` line naming the file and the
field (``summary.json: variants[0].final_loss: expected a number, got list``), never an
AttributeError, KeyError or OverflowError deep inside a report. Fields not listed are not
checked (a newer precisionlab may add some); listed ones must have the type given.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from precisionlab import _io

__all__ = ["SCHEMAS", "check", "read_json", "read_jsonl"]

#: Largest integer accepted anywhere in a run file (precisionlab writes int64 at most): a
#: 400-digit integer would overflow every conversion to float.
MAX_INT = 2**63

_NUM = "num"  # int, float, or the strings "nan", "inf", "-inf" (strict JSON's non-finite)
_SAFE_ID = re.compile(r"^[A-Za-z0-9_.+=^-]{1,200}$")

_VARIANT = {
    "id": "!id",
    "name": "!str",
    "status": "?str",
    "error": "?str",
    "group": "?str",
    "setting": "?str",
    "variant": "?str",
    "seed": "?int",
    "steps": "?int",
    "final_loss": "?num",
    "final_loss_finite": "?num",
    "eval_loss": "?num",
    "eval_metric": "?num",
    "skipped_steps": "?int",
    "diverged": "?bool",
    "divergence_step": "?int",
    "min_loss_scale": "?num",
    "max_loss_scale": "?num",
    "mean_underflow_fraction": "?num",
    "wall_time_s": "?num",
    "recipe_metrics": "?dict",
    "telemetry": "?dict",
}
_RESOLVED = {
    "report": "dict",
    "train": "dict",
    "settings": "dict",
    "setting_descriptions": "dict",
    "variants": ("list", {"name": "!str"}),
}
_HIST = {"counts": "!nums", "edges": "nums", "zeros": "num", "nonfinite": "num"}
_GROUP = {"group": "?str", "seeds": "?list", "diverged": "?int", "failed": "?int"}

#: File name -> {field: type}; a type is ``str``, ``int``, ``num``, ``nums`` (a list of
#: numbers), ``bool``, ``dict``,
#: ``list``, ``id`` (one safe path component), a ``?`` prefix for "or null", ``!`` for a
#: field that must be present (others may be absent), a
#: ``("list", schema)`` pair for a list of records or ``("dict", schema)`` for a table.
SCHEMAS: dict[str, dict[str, Any]] = {
    "config.json": {
        "source": "?str",
        "overrides": "?list",
        "document": "dict",  # resume needs it (runner.resume says so)
        "resolved": ("dict", _RESOLVED),
    },
    "summary.json": {
        "kind": "!str",
        "name": "?str",
        "description": "?str",
        "status": "?str",
        "error": "?str",
        "result": "?dict",
        "final_loss_window": "?int",
        "variants": ("list", _VARIANT),
        "groups": ("list", _GROUP),
    },
    "run.json": {"status": "?str", "kind": "?str", "resumed": "?int", "created": "?str"},
    "environment.json": {"resumed_with": "?list"},
    "status.json": {
        "status": "?str",
        "name": "?str",
        "error": "?str",
        "result": "?dict",
        "summary": "?dict",
        "wall_time_s": "?num",
    },
    "metrics.jsonl": {
        "step": "?int",
        "loss": "?num",
        "loss_scale": "?num",
        "underflow_fraction": "?num",
        "skipped": "?bool",
        "grad_norm": "?num",
        "metric": "?num",
        "lr": "?num",
        "eval_loss": "?num",
        "eval_metric": "?num",
        "diverged": "?bool",
    },
    "hist.jsonl": {"step": "?int", "grad_hist": ("dict", _HIST), "act_hist": ("dict", _HIST)},
    "telemetry.jsonl": {"step": "?int", "kind": "!str", "layer": "!str", "tensor": "?str"},
    "predictors.jsonl": {
        "step": "!int",
        "layers": "!list",
        "signals": "!dict",
        "loss": "?num",
        "loss_scale": "?num",
        "skipped": "?bool",
        "meta": "?dict",
    },
}


def _type_ok(value: Any, kind: str) -> bool:
    if kind.startswith("?"):
        return value is None or _type_ok(value, kind[1:])
    if kind == "num":
        if isinstance(value, str):
            return value in ("nan", "inf", "-inf")
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "nums":
        return isinstance(value, list) and all(_type_ok(v, "num") for v in value)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "id":
        return isinstance(value, str) and bool(_SAFE_ID.match(value)) and value not in (".", "..")
    return isinstance(value, {"str": str, "bool": bool, "dict": dict, "list": list}[kind])


def _describe(kind: str) -> str:
    base = kind.lstrip("?")
    text = {
        "num": "a number",
        "nums": "a list of numbers",
        "int": "an integer",
        "str": "a string",
        "bool": "true or false",
        "dict": "an object",
        "list": "a list",
        "id": "a variant id (letters, digits, _ . + = ^ -)",
    }[base]
    return text + (" or null" if kind.startswith("?") else "")


def _check_ints(data: Any, where: str) -> None:
    """No integer anywhere in ``data`` past :data:`MAX_INT` (iterative: depth is bounded by
    the JSON parser already, but a report must not recurse either)."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, int) and not isinstance(item, bool) and abs(item) >= MAX_INT:
            raise _io.DamagedFileError(f"{where}: an integer of {len(str(item))} digits")
        elif isinstance(item, float) and not math.isfinite(item):  # a NaN literal: not JSON
            raise _io.DamagedFileError(f"{where}: the literal {item!r} is not strict JSON")


def check(data: Any, schema: dict[str, Any], where: str) -> Any:
    """``data`` if it is an object whose listed fields have their types; DamagedFileError
    naming ``where`` and the field otherwise."""
    if not isinstance(data, dict):
        raise _io.DamagedFileError(f"{where}: expected a JSON object, got {type(data).__name__}")
    for key, kind in schema.items():
        if key not in data:
            if isinstance(kind, str) and kind.startswith("!"):
                raise _io.DamagedFileError(f"{where}: missing field {key!r}")
            continue  # an absent field reads as its default where it is used
        value = data[key]
        kind = kind.lstrip("!") if isinstance(kind, str) else kind
        if isinstance(kind, tuple) and kind[0] == "dict":
            check(value, kind[1], f"{where}: {key}")
        elif isinstance(kind, tuple):
            if not isinstance(value, list):
                raise _io.DamagedFileError(
                    f"{where}: {key}: expected a list, got {type(value).__name__}"
                )
            for i, item in enumerate(value):
                check(item, kind[1], f"{where}: {key}[{i}]")
        elif not _type_ok(value, kind):
            raise _io.DamagedFileError(
                f"{where}: {key}: expected {_describe(kind)}, got {type(value).__name__} "
                f"{str(value)[:40]!r}"
            )
    return data


def read_json(path: str | os.PathLike) -> Any:
    """A run file read with :func:`precisionlab._io.read_json` and checked against the schema
    of its name (:data:`SCHEMAS`; any other name: integers only checked)."""
    data = _io.read_json(path)
    _check_ints(data, os.fspath(path))
    schema = SCHEMAS.get(Path(path).name)
    if schema is None:
        return data
    check(data, schema, os.fspath(path))
    if Path(path).name == "summary.json" and data["kind"] == "train" and "variants" not in data:
        raise _io.DamagedFileError(f"{os.fspath(path)}: missing field 'variants'")
    return data


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a run's JSONL file, each checked as :func:`read_json` checks a file."""
    rows = _io.read_jsonl(path)
    schema = SCHEMAS.get(Path(path).name)
    for number, row in enumerate(rows, 1):
        _check_ints(row, f"{os.fspath(path)} line {number}")
        if schema is not None:
            check(row, schema, f"{os.fspath(path)} line {number}")
    return rows
