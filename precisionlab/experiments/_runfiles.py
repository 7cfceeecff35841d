"""The fields precisionlab reads back from a run directory, checked when each file is read.

A run directory is data on disk that anyone may have edited, truncated or replaced: every
file of it is read through :func:`read_json` / :func:`read_jsonl` (regular files only, size
limits: :mod:`precisionlab._io`), then checked against the schema of its name here, so a
damaged file is one :class:`~precisionlab._io.DamagedFileError` line naming the file and the
field (``summary.json: variants[0]: final_loss: expected a number, got list``), nested
fields included, never an
AttributeError, KeyError or OverflowError deep inside a report. Fields not listed are not
checked (a newer precisionlab may add some); listed ones must have the type given. The
schemas are :class:`precisionlab._schema.Field` tables, the language of every other table.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from precisionlab import _io
from precisionlab._schema import ConfigError, Field, check_data

__all__ = ["SCHEMAS", "check", "read_json", "read_jsonl"]

#: Largest integer accepted anywhere in a run file (precisionlab writes int64 at most): a
#: 400-digit integer would overflow every conversion to float.
MAX_INT = 2**63

_SAFE_ID = re.compile(r"^[A-Za-z0-9_.+=^-]{1,200}$")


def _safe_id(value: str) -> str:
    if not _SAFE_ID.match(value) or value in (".", ".."):
        raise ValueError(f"{value[:40]!r} is not a variant id (letters, digits, _ . + = ^ -)")
    return value


def _has(kind: type, **kw: Any) -> Field:
    """A field that must be present (not null unless ``nullable=True``)."""
    return Field(kind, **kw)


def _may(kind: type, **kw: Any) -> Field:
    """A field that may be absent or null."""
    return Field(kind, default=None, nullable=True, **kw)


_NUM: dict[str, Any] = {"nonfinite": True}  # a JSON number, or "nan"/"inf"/"-inf"
_COUNT: dict[str, Any] = {"low": 0}


def _num() -> Field:
    return _may(float, **_NUM)


def _records(fields: dict[str, Field], *, present: bool = False) -> Field:
    """A list of tables of ``fields`` (present: the key must be there)."""
    return (_has if present else _may)(list, item=dict, fields=fields)


def _edges_fit(hist: dict[str, Any]) -> None:
    counts, edges = hist.get("counts"), hist.get("edges")
    if isinstance(counts, list) and isinstance(edges, list) and len(edges) != len(counts) + 1:
        raise ValueError(f"{len(edges)} edges for {len(counts)} counts (needs counts + 1)")


#: A tensor's naming fields in telemetry rows and their summary entries.
_NAMED = {
    "kind": _has(str),
    "layer": _has(str),
    "site": _may(str),
    "tensor": _has(str, nullable=True),
    "where": _may(str),
}
_RANKED_ENTRY = {**_NAMED, "fraction": _has(float, **_NUM), "step": _has(int, **_COUNT),
                 "target": _may(str)}  # fmt: skip
_TELEMETRY_SUMMARY = {
    "first_nonfinite": _may(dict, fields={
        **_NAMED, "step": _has(int, **_COUNT), "n_inf": _has(int, **_COUNT),
        "n_nan": _has(int, **_COUNT), "n": _has(int, **_COUNT), "backward": _has(bool),
    }),
    "most_nonfinite": _records(_RANKED_ENTRY),
    "most_zeros": _records(_RANKED_ENTRY),
    "steps": _has(list, item=int),
    "targets": _has(list, item=str),
    "worst_underflow": _records(_RANKED_ENTRY),
    "worst_overflow": _records(_RANKED_ENTRY),
    "widest_dynamic_range": _records(
        {**_NAMED, "binades": _has(float, **_NUM), "step": _has(int, **_COUNT)}
    ),
}  # fmt: skip
_VARIANT = {
    "id": _has(str, check=_safe_id),
    "name": _has(str),
    "status": _may(str),
    "error": _may(str),
    "group": _may(str),
    "setting": _may(str),
    "variant": _may(str),
    "seed": _may(int),
    "steps": _may(int, **_COUNT),
    "final_loss": _num(),
    "final_loss_finite": _num(),
    "eval_loss": _num(),
    "eval_metric": _num(),
    "skipped_steps": _may(int, **_COUNT),
    "diverged": _may(bool),
    "divergence_step": _may(int, **_COUNT),
    "first_nonfinite_step": _may(int, **_COUNT),
    "min_loss_scale": _num(),
    "max_loss_scale": _num(),
    "mean_underflow_fraction": _num(),
    "mean_nonfinite_fraction": _num(),
    "wall_time_s": _num(),
    "recipe_metrics": _may(dict, values=_may(dict, values=_num())),
    "telemetry": _may(dict, fields=_TELEMETRY_SUMMARY),
}
_RESOLVED = {
    "report": _may(dict),
    "train": _may(dict),
    "settings": _may(dict),
    "setting_descriptions": _may(dict),
    "variants": _records({"name": _has(str)}),
    "units": _records({"id": _has(str, check=_safe_id), "params": _may(dict)}),
}
_HIST = _may(dict, check=_edges_fit, fields={
    "counts": _has(list, item=float, low=0, **_NUM),
    "edges": _may(list, item=float, **_NUM),
    "zeros": _may(float, low=0, **_NUM),
    "nonfinite": _may(float, low=0, **_NUM),
})  # fmt: skip
_GROUP = {
    "group": _has(str),
    "seeds": _may(list, item=int),
    "n": _has(int, **_COUNT),
    "diverged": _has(int, **_COUNT),
    "failed": _may(int, **_COUNT),
}
_STAT_KEYS = ("final_loss", "final_loss_finite", "eval_loss", "eval_metric", "skipped_steps",
              "divergence_step", "mean_underflow_fraction", "mean_nonfinite_fraction",
              "min_loss_scale", "max_loss_scale",
              "wall_time_s")  # fmt: skip
_GROUP.update({f"{k}_{s}": _num() for k in _STAT_KEYS for s in ("mean", "std")})

_SECONDS = {"wall_s": _has(float, **_NUM), "cpu_s": _has(float, **_NUM)}

#: File name -> its table's fields (:class:`precisionlab._schema.Field`, the one schema
#: language of precisionlab; nested tables and lists of records included). A field whose
#: default is REQUIRED must be present; a listed field must have its type and range.
SCHEMAS: dict[str, dict[str, Field]] = {
    "config.json": {
        "source": _may(str),
        "overrides": _may(list, item=str),
        "document": _may(dict),  # resume needs it (runner.resume says so)
        "resolved": _may(dict, fields=_RESOLVED),
        "config_hash": _may(str),
    },
    "summary.json": {
        "kind": _has(str),
        "name": _may(str),
        "description": _may(str),
        "status": _may(str),
        "error": _may(str),
        "result": _may(dict),
        "final_loss_window": _may(int, **_COUNT),
        "variants": _records(_VARIANT),
        "groups": _records(_GROUP),
        "config_hash": _may(str),
    },
    "run.json": {
        "status": _may(str),
        "kind": _may(str),
        "resumed": _may(int, **_COUNT),
        "created": _may(str),
        "config_hash": _may(str),
        "killed": _may(list, item=str),
    },
    "environment.json": {"resumed_with": _may(list, item=dict)},
    "status.json": {
        "status": _may(str),
        "name": _may(str),
        "error": _may(str),
        "result": _may(dict),
        "summary": _may(dict, fields={**_VARIANT, "id": _may(str, check=_safe_id)}),
        "wall_time_s": _num(),
        "config_hash": _may(str),
    },
    "metrics.jsonl": {
        "step": _may(int, **_COUNT),
        "loss": _num(),
        "loss_scale": _num(),
        "underflow_fraction": _num(),
        "nonfinite_fraction": _num(),
        "skipped": _may(bool),
        "grad_norm": _num(),
        "metric": _num(),
        "lr": _num(),
        "eval_loss": _num(),
        "eval_metric": _num(),
        "diverged": _may(bool),
    },
    "hist.jsonl": {"step": _may(int, **_COUNT), "grad_hist": _HIST, "act_hist": _HIST},
    "telemetry.jsonl": {
        **_NAMED,
        "step": _has(int, **_COUNT),
        "n": _has(int, **_COUNT),
        "n_nan": _may(int, **_COUNT),
        "n_inf": _may(int, **_COUNT),
        "frac_zero": _num(),
        "frac_nonfinite": _num(),
        "amax": _num(),
        "amin_nonzero": _num(),
        "dynamic_range": _num(),
        "targets": _may(dict, values=_may(dict, values=_num())),
    },
    "timings.json": {
        "units": _has(
            dict,
            values=_has(
                dict,
                fields={
                    "name": _has(str),
                    "wall_s": _num(),
                    "cpu_s": _num(),
                    "loop": _may(dict),
                },
            ),
        ),
        "report": _may(dict, values=_num()),
        "process": _may(
            dict,
            fields={
                "phases": _has(dict, values=_has(dict, fields=_SECONDS)),
                "total": _has(dict, fields=_SECONDS),
                "unaccounted": _has(dict, fields=_SECONDS),
            },
        ),
    },
    "predictors.jsonl": {
        "step": _has(int, **_COUNT),
        "layers": _has(list),
        "signals": _has(dict),
        "loss": _num(),
        "loss_scale": _num(),
        "skipped": _may(bool),
        "meta": _may(dict),
    },
}


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


def check(data: Any, schema: dict[str, Field], where: str) -> Any:
    """``data`` if it is an object whose listed fields (nested ones included) have their
    types (:func:`precisionlab._schema.check_data`); DamagedFileError naming ``where`` and the
    field otherwise."""
    if not isinstance(data, dict):
        raise _io.DamagedFileError(f"{where}: expected a JSON object, got {type(data).__name__}")
    try:
        return check_data(data, schema, where)
    except ConfigError as err:
        raise _io.DamagedFileError(str(err)) from None


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
