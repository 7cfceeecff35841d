"""Byte sizes with explicit units: decimal (GB = 1e9 bytes) and binary (GiB = 2**30 bytes).

``parse_size("80GiB") == 85899345920``; ``format_size(350e9, "GB") == "350.00 GB"``.
"""

from __future__ import annotations

import decimal
import re

__all__ = ["UNITS", "format_size", "parse_size"]

#: Unit name -> bytes. Decimal units are powers of 1000, binary units (with an "i") powers of 1024.
UNITS: dict[str, int] = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}
_BY_LOWER = {name.lower(): name for name in UNITS}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]+)\s*$")


def parse_size(text: str) -> int:
    """Bytes named by ``text``: a number and a unit, e.g. ``"80GiB"``, ``"1.5 TB"``, ``"512B"``.

    Units: B, KB, MB, GB, TB (powers of 1000) and KiB, MiB, GiB, TiB (powers of 1024), case
    insensitive. The result must be a positive whole number of bytes.

    Raises:
      ValueError: naming the text and the allowed units when it is malformed.
    """
    if not isinstance(text, str):
        raise TypeError(f"size must be a string such as '80GiB', got {type(text).__name__}")
    match = _SIZE.match(text)
    allowed = ", ".join(UNITS)
    if not match:
        raise ValueError(f"malformed size {text!r}: expected a number and a unit ({allowed})")
    number, unit = match.groups()
    if unit.lower() not in _BY_LOWER:
        raise ValueError(f"unknown unit {unit!r} in size {text!r}; allowed: {allowed}")
    value = decimal.Decimal(number) * UNITS[_BY_LOWER[unit.lower()]]
    if value != value.to_integral_value():
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    if value > 2**70:
        raise ValueError(f"size {text!r} is beyond 1 ZiB (2^70 bytes); give a real memory size")
    return int(value)


def format_size(n_bytes: float, unit: str = "GB", digits: int = 2) -> str:
    """``n_bytes`` in ``unit`` (one of :data:`UNITS`), e.g. ``"350.00 GB"``."""
    if unit not in UNITS:
        raise ValueError(f"unknown unit {unit!r}; allowed: {', '.join(UNITS)}")
    return f"{n_bytes / UNITS[unit]:.{digits}f} {unit}"
