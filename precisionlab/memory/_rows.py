"""Byte tables: a dataclass of byte counts shown as labelled rows and written as a dict."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

__all__ = ["byte_dict", "byte_rows", "byte_sum"]


def byte_sum(obj: Any, names: Iterable[str]) -> int:
    """The sum of ``obj``'s byte counts called ``names``."""
    return sum(getattr(obj, name) for name in names)


def byte_rows(obj: Any, rows: Iterable[tuple[str, str]]) -> list[tuple[str, int]]:
    """``(label, bytes)`` of ``obj`` for each ``(label, attribute)`` of ``rows``, in order."""
    return [(label, getattr(obj, name)) for label, name in rows]


def byte_dict(obj: Any, derived: Iterable[str]) -> dict[str, Any]:
    """The fields of the dataclass ``obj``, then its properties called ``derived``."""
    return {**dataclasses.asdict(obj), **{name: getattr(obj, name) for name in derived}}
