"""What the benchmarks (``precisionlab bench ...``) print and write: the ``--json``/``--out``
options, where a bench ran, fixed-width tables, and the one way a result is printed."""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax

from precisionlab import _io

__all__ = [
    "add_output_arguments",
    "cpu_name",
    "device_and_cpu",
    "machine",
    "print_result",
    "print_rows",
    "rows_text",
]


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """A bench's ``--json`` (print the results as JSON) and ``--out OUT`` (also write them)."""
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON to OUT")


def rows_text(head: str, lines: Iterable[str]) -> str:
    """A fixed-width table: its ``head`` line, a dashed rule as wide, then ``lines``."""
    return "\n".join([head, "-" * len(head), *lines])


def print_rows(head: str, lines: Iterable[str]) -> None:
    """Print :func:`rows_text`."""
    print(rows_text(head, lines))


def print_result(
    result: Any, args: argparse.Namespace, render: Callable[[Any], str], *, indent: int = 2
) -> None:
    """Print a bench's ``result``: as JSON (``indent``) with ``--json``, else ``render(result)``;
    first written as JSON to ``--out`` where the bench has that option and it was given."""
    out = getattr(args, "out", None)
    if out is not None:
        _io.write_json(out, result)
    print(json.dumps(result, indent=indent) if args.json else render(result))


def cpu_name() -> str:
    """This machine's processor as :mod:`platform` names it, else its architecture (``x86_64``)."""
    return platform.processor() or platform.machine()


def device_and_cpu() -> str:
    """Where a bench ran, for its heading: ``PLATFORM, CPU`` (the first JAX device's platform,
    :func:`cpu_name`)."""
    return f"{jax.devices()[0].platform}, {cpu_name()}"


def machine() -> dict[str, Any]:
    """Where a bench ran, for its JSON: ``backend``, ``devices``, ``jax`` (version),
    ``cpu_count``."""
    return {
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "jax": jax.__version__,
        "cpu_count": os.cpu_count(),
    }
