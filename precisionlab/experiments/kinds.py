"""The registry of experiment kinds: the TOML top-level ``kind`` -> the module that runs it.

A kind other than ``train`` is a module exposing ``KIND``, ``validate(section, where) -> dict``
and ``run(section, out_dir, *, quiet=False) -> dict`` (see the project rules). Modules are
imported only when a file of that kind is loaded, so a missing optional kind does not stop the
others; loading one that is missing raises a ``ValueError`` saying which module is needed.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = ["KINDS", "load", "names_text", "train_schema", "train_validate"]

#: kind -> module implementing it.
KINDS: dict[str, str] = {
    "train": "precisionlab.experiments.train_kind",
    "survey": "precisionlab.survey",
    "memory": "precisionlab.memory.experiment",
}

_REQUIRED = {"train": ("schema", "validate", "run_unit"), "*": ("KIND", "validate", "run")}


def names_text() -> str:
    return ", ".join(KINDS)


def load(kind: str) -> ModuleType:
    """The module of ``kind``, imported now.

    Raises:
      ValueError: if ``kind`` is unknown, or its module (or something it needs) is missing.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown experiment kind {kind!r}; allowed: {names_text()}")
    name = KINDS[kind]
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as err:
        raise ValueError(
            f"experiment kind {kind!r} needs module {name}, which cannot be imported "
            f"(missing: {err.name})"
        ) from None
    needed = _REQUIRED.get(kind, _REQUIRED["*"])
    missing = [attr for attr in needed if not hasattr(module, attr)]
    if missing:
        raise ValueError(
            f"experiment kind {kind!r}: module {name} lacks {', '.join(missing)} "
            "of the kind protocol"
        )
    return module


def train_schema() -> dict[str, Any]:
    """The keys of a ``[train]`` table (name -> :class:`~precisionlab.experiments.schema.Field`)."""
    return load("train").schema()


def train_validate(table: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``[train]`` table validated with defaults filled in."""
    return load("train").validate(table, where)
