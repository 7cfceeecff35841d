"""Byte tables: a dataclass of byte counts shown as labelled rows and written as a dict."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, ClassVar

__all__ = ["ByteRows"]


class ByteRows:
    """Base of a frozen dataclass of byte counts: ``_ROWS`` lists each displayed row as
    ``(label, attribute)`` (a field or a property) in display order, ``_DERIVED`` the
    properties :meth:`to_dict` adds after the fields."""

    __dataclass_fields__: ClassVar[dict[str, Any]]
    _ROWS: ClassVar[tuple[tuple[str, str], ...]]
    _DERIVED: ClassVar[tuple[str, ...]]

    def sum_of(self, names: Iterable[str]) -> int:
        """The sum of the named byte counts."""
        return sum(getattr(self, name) for name in names)

    def rows(self) -> list[tuple[str, int]]:
        """(label, bytes) in display order."""
        return [(label, getattr(self, name)) for label, name in self._ROWS]

    def to_dict(self) -> dict[str, Any]:
        """The fields, then the derived totals, as plain values."""
        return {**dataclasses.asdict(self), **{name: getattr(self, name) for name in self._DERIVED}}
