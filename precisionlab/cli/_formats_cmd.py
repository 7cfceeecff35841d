"""``precisionlab formats``: every built-in format with the properties derived from its bits."""

from __future__ import annotations

import argparse
import json
import math

from precisionlab.cli._render import number_str, specials_str, table
from precisionlab.formats import ALIASES, FORMATS, FloatFormat, Format, IntFormat

HELP = "list the built-in formats with their derived properties (max, eps, range, specials)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON array, one per format")


def _aliases(name: str) -> list[str]:
    return sorted(alias for alias, target in ALIASES.items() if target == name)


def describe(fmt: Format) -> dict:
    """The derived properties of one format as a JSON-able dict (exact values as floats;
    null where the format has no such value)."""
    common = {"name": fmt.name, "aliases": _aliases(fmt.name), "bits": fmt.bits}
    if isinstance(fmt, IntFormat):
        return common | {
            "kind": "int",
            "signed": fmt.signed,
            "min": fmt.min,
            "max": fmt.max,
            "finite_count": fmt.num_finite,
        }
    has_subnormals = fmt.subnormals and fmt.mantissa_bits > 0
    return common | {
        "kind": "float",
        "signed": fmt.signed,
        "exponent_bits": fmt.exponent_bits,
        "mantissa_bits": fmt.mantissa_bits,
        "bias": fmt.bias,
        "max": fmt.max,
        "smallest_normal": fmt.smallest_normal,
        "smallest_subnormal": fmt.smallest_subnormal if has_subnormals else None,
        "eps": fmt.eps,
        "unit_roundoff": fmt.unit_roundoff,
        "finite_count": fmt.num_finite,
        "binades": fmt.dynamic_range_binades,
        "specials": str(fmt.specials),
        "has_inf": fmt.has_inf,
        "has_nan": fmt.has_nan,
        "negative_zero": fmt.has_negative_zero,
    }


def _count(n: int) -> str:
    """Exact up to a million, then 4 significant digits (--json has the exact count)."""
    return str(n) if n < 10**6 else f"{n:.4g}"


def _float_row(fmt: FloatFormat, d: dict) -> list[str]:
    sub = d["smallest_subnormal"]
    return [
        fmt.name,
        str(d["bits"]),
        f"e{fmt.exponent_bits}m{fmt.mantissa_bits}",
        str(d["bias"]),
        number_str(d["max"], 5),
        number_str(d["smallest_normal"], 5),
        "-" if sub is None else number_str(sub, 5),
        number_str(d["eps"], 4),
        number_str(d["unit_roundoff"], 4),
        _count(d["finite_count"]),
        f"{d['binades']:.1f}" if math.isfinite(d["binades"]) else "inf",
        specials_str(fmt) + ("" if fmt.signed else ", unsigned"),
    ]


def run(args: argparse.Namespace) -> int:
    described = [(fmt, describe(fmt)) for fmt in FORMATS.values()]
    if args.json:
        print(json.dumps([d for _, d in described], indent=2, allow_nan=False))
        return 0
    floats = [_float_row(f, d) for f, d in described if isinstance(f, FloatFormat)]
    headers = ["format", "bits", "layout", "bias", "max", "min normal", "min subnormal"]
    headers += ["eps", "unit roundoff", "finite", "binades", "inf/nan"]
    print(table(floats, headers, align="lrlrrrrrrrrl"))
    ints = [
        [f.name, str(f.bits), "yes" if f.signed else "no", str(f.min), str(f.max)]
        for f, _ in described
        if isinstance(f, IntFormat)
    ]
    print()
    print(table(ints, ["format", "bits", "signed", "min", "max"]))
    print(
        "\neps: gap between 1 and the next value; unit roundoff: eps/2, the largest relative "
        "error of round-to-nearest in the normal range;\nbinades: log2(max / smallest "
        "positive); finite: codes with a finite value (both zeros counted)."
    )
    return 0
