"""``precisionlab env``: versions, backend, devices, and whether this backend flushes float32
subnormals in jitted code (measured here, not assumed)."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np

HELP = "show versions, backend, devices, and whether this backend flushes float32 subnormals"

# A float32 subnormal (smallest normal is ~1.18e-38) whose double is also subnormal.
PROBE = 1e-39


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def measure_subnormals() -> dict[str, bool]:
    """Run two jitted float32 probes on the default backend.

    Returns ``{"arithmetic_flushes": ..., "comparison_flushes": ...}``: whether
    ``jit(lambda x: x * 2)(1e-39)`` loses the subnormal (gives anything but the exact
    ``2e-39`` rounded to float32) and whether ``jit(lambda x: x > 0)(1e-39)`` is False.
    """
    x = jnp.asarray(np.float32(PROBE), dtype=jnp.float32)
    doubled = np.asarray(jax.jit(lambda v: v * jnp.float32(2))(x))
    positive = bool(jax.jit(lambda v: v > jnp.float32(0))(x))
    expected = np.float32(PROBE) * np.float32(2)  # numpy keeps subnormals (IEEE on the host)
    return {
        "arithmetic_flushes": bool(doubled != expected),
        "comparison_flushes": not positive,
    }


def collect() -> dict:
    """Everything ``env`` reports, as a JSON-able dict."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {
            dist: _version(dist)
            for dist in ("precisionlab", "jax", "jaxlib", "ml_dtypes", "numpy", "gfloat")
        },
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "x64_enabled": bool(jax.config.jax_enable_x64),  # type: ignore[attr-defined]  # made at run time
        "float32_subnormals": measure_subnormals(),
    }


def meaning(flush: dict[str, bool]) -> str:
    """One sentence on what the measured flushing means for users."""
    if flush["arithmetic_flushes"] or flush["comparison_flushes"]:
        return (
            "This backend treats float32 subnormals (|x| < 1.18e-38) as zero in jitted float "
            "arithmetic or comparisons, so code computing on such tiny values here may differ "
            "from IEEE results; precisionlab's codecs are exact regardless because they work "
            "on integer bit patterns."
        )
    return (
        "This backend keeps float32 subnormals in jitted arithmetic and comparisons (IEEE "
        "behaviour); precisionlab's codecs are exact either way because they work on integer "
        "bit patterns."
    )


def run(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    flush = info["float32_subnormals"]
    versions = "  ".join(f"{k} {v or '(not installed)'}" for k, v in info["versions"].items())
    print(f"python      {info['python']} ({sys.implementation.name}) on {info['platform']}")
    print(f"versions    {versions}")
    print(f"backend     {info['backend']}  (x64 {'on' if info['x64_enabled'] else 'off'})")
    print(f"devices     {', '.join(info['devices'])}")
    arith = "flushed to 0" if flush["arithmetic_flushes"] else "kept (2e-39)"
    compare = "False: x treated as 0" if flush["comparison_flushes"] else "True: kept"
    print(f"subnormals  float32 x = {PROBE:g} under jit: x * 2 -> {arith}; x > 0 -> {compare}")
    indent = " " * 12
    print(textwrap.fill(meaning(flush), 96, initial_indent=indent, subsequent_indent=indent))
    return 0
