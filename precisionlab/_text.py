"""Neutral text helpers shared by the CLI, the benchmarks and the experiment reports.

The ground floor: it imports nothing of precisionlab, so the benchmarks and the reports use
these without importing the CLI (and the CLI re-exports them).

- :class:`UsageError`: bad command-line input (printed as one line, exit status 2).
- :func:`split_list`: ``"a,b, c"`` -> ``["a", "b", "c"]``.
- :func:`table`: cells laid out in columns separated by two spaces, with a dashed rule under the
  headers; numbers right-aligned by default. ANSI codes have zero display width
  (:func:`visible_len`).
- :func:`fmt_value`: one number of a summary table in a named style (``g4``, ``pct``, ``pow2``...).
- :func:`check_processes`: a multi-process run's ``HOST:PORT``, process count and index.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

__all__ = ["UsageError", "check_processes", "fmt_value", "split_list", "table", "visible_len"]


class UsageError(Exception):
    """Bad command-line input: printed as one line on stderr, exit status 2."""


def split_list(text: str) -> list[str]:
    """Split ``"a,b, c"`` into ``["a", "b", "c"]`` (empty items dropped)."""
    return [item.strip() for item in text.split(",") if item.strip()]


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NUMBER = re.compile(r"^[-+]?(\d[\d_,]*\.?\d*|\.\d+)([eE][-+]?\d+)?[x%]?$|^[-+]?(inf|nan)$")


def visible_len(text: str) -> int:
    """Display width of ``text``: its length without ANSI escape sequences."""
    return len(_ANSI.sub("", text))


def _looks_numeric(cell: str) -> bool:
    return bool(_NUMBER.match(_ANSI.sub("", cell).strip()))


def table(
    rows: Sequence[Sequence[object]],
    headers: Sequence[str],
    align: str | Sequence[str] | None = None,
) -> str:
    """Format ``rows`` under ``headers`` as an aligned plain-text table (no trailing newline).

    Args:
      rows: one sequence of cells per row; cells are converted with ``str`` (``None`` -> "").
        Rows shorter than ``headers`` are padded with empty cells; longer rows are an error.
      headers: column titles.
      align: per column ``"l"`` (left) or ``"r"`` (right), as a string like ``"lrr"`` or a
        sequence; ``None`` right-aligns columns whose non-empty cells all look numeric.

    Raises:
      ValueError: if a row has more cells than there are headers, or ``align`` is malformed.
    """
    ncol = len(headers)
    cells = []
    for i, row in enumerate(rows):
        if len(row) > ncol:
            raise ValueError(f"row {i} has {len(row)} cells but there are {ncol} headers")
        text = ["" if c is None else str(c) for c in row]
        cells.append(text + [""] * (ncol - len(text)))
    if align is None:
        align = [
            "r" if any(r[j] for r in cells) and all(_looks_numeric(r[j]) for r in cells if r[j])
            else "l"
            for j in range(ncol)
        ]  # fmt: skip
    align = list(align)
    if len(align) != ncol or any(a not in ("l", "r") for a in align):
        raise ValueError(f"align must give 'l' or 'r' for each of {ncol} columns, got {align!r}")
    widths = [
        max([visible_len(h) for h in [headers[j]]] + [visible_len(r[j]) for r in cells])
        for j in range(ncol)
    ]

    def line(items: Sequence[str]) -> str:
        out = []
        for item, width, a in zip(items, widths, align, strict=True):
            pad = " " * (width - visible_len(item))
            out.append(pad + item if a == "r" else item + pad)
        return "  ".join(out).rstrip()

    lines = [line(list(headers)), "  ".join("-" * w for w in widths)]
    lines += [line(r) for r in cells]
    return "\n".join(lines)


def fmt_value(value: Any, how: str, row: dict[str, Any]) -> str:
    """``value`` as a table cell: ``how`` is ``s`` (str), ``d`` (int), ``g4``, ``f1``, ``pct``,
    ``pow2`` (``2^k`` for a power of two) or ``div`` (the divergence column of ``row``); None is
    "-", a non-finite float its name."""
    if how == "div":
        return "-" if not row.get("diverged") else str(value if value is not None else "yes")
    if value is None:
        return "-"
    if how == "s":
        return str(value)
    if how == "d":
        return str(int(value))
    value = float(value)
    if not math.isfinite(value):
        return str(value)
    if how == "g4":
        return f"{value:.4g}"
    if how == "f1":
        return f"{value:.1f}"
    if how == "pct":
        return f"{100 * value:.1f}%"
    if how == "pow2":
        if value > 0 and float(math.log2(value)).is_integer():
            return f"2^{int(math.log2(value))}"
        return f"{value:.3g}"
    raise ValueError(f"unknown format {how!r}")


_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)$")
#: Longest host name (RFC 1035: 253 characters); a longer one is refused before any lookup.
_HOST_MAX = 253
#: JAX takes the process count and the timeout as C++ ints (int32).
_PROCESSES_MAX = 2**31 - 1


def check_processes(coordinator: Any, num_processes: Any, process_id: Any, timeout_s: Any) -> None:
    """ValueError naming the bad value unless ``coordinator`` is ``"HOST:PORT"`` (``"[::1]:PORT"``
    for IPv6, port 1..65535, host at most 253 characters), ``num_processes`` and ``timeout_s``
    are ints in [1, 2**31 - 1] and ``process_id`` is in ``[0, num_processes)`` (the arguments
    of a multi-process run; plain Python, so the command line checks them without importing
    JAX)."""
    if not isinstance(coordinator, str) or ":" not in coordinator:
        raise ValueError(f"coordinator address must be HOST:PORT, got {coordinator!r}")
    host, _, port = coordinator.rpartition(":")
    if not host or len(host) > _HOST_MAX or not _HOST.match(host):
        raise ValueError(
            f"coordinator address {coordinator!r}: bad host {host!r} (a name or address of at "
            f"most {_HOST_MAX} characters)"
        )
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise ValueError(
            f"coordinator address {coordinator!r}: port must be 1..65535, got {port!r}"
        )
    for name, value in (("num_processes", num_processes), ("timeout_s", timeout_s)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if value > _PROCESSES_MAX:
            raise ValueError(f"{name} must be an int <= {_PROCESSES_MAX} (int32), got {value!r}")
    if isinstance(process_id, bool) or not isinstance(process_id, int):
        raise ValueError(f"process_id must be an int, got {process_id!r}")
    if not 0 <= process_id < num_processes:
        raise ValueError(
            f"process_id must be in [0, {num_processes - 1}] for {num_processes} processes, "
            f"got {process_id}"
        )
