"""``precisionlab values FORMAT``: every code of a format of 8 bits or fewer, like the value
tables of the OCP 8-bit floating point specification."""

from __future__ import annotations

import argparse
import json
import math
from decimal import Decimal

from precisionlab.cli._common import UsageError
from precisionlab.cli._render import (
    code_class,
    code_fields,
    decimal_str,
    draw_code,
    hex_code,
    table,
    use_color,
)
from precisionlab.formats import Format, IntFormat, get_format

HELP = "list every code of a format of 8 bits or fewer with its bits, value and class"

MAX_BITS = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("format", metavar="FORMAT", help="a format of <= 8 bits, e.g. e4m3fn")
    parser.add_argument("--json", action="store_true", help="print a JSON array, one per code")


def rows(fmt: Format) -> list[dict]:
    """One dict per code, in code order: code, hex, binary, sign, exponent, mantissa, value
    (exact; non-finite as "inf"/"-inf"/"nan"), class."""
    out = []
    for code in range(1 << fmt.bits):
        value = fmt.value_of(code)
        sign, exponent, mantissa = code_fields(fmt, code)
        if isinstance(value, float) and not math.isfinite(value):
            shown: float | int | str = decimal_str(Decimal(value))
        else:
            shown = value
        out.append(
            {
                "code": code,
                "hex": hex_code(code, fmt.bits),
                "binary": f"{code:0{fmt.bits}b}",
                "sign": sign,
                "exponent": exponent,
                "mantissa": mantissa,
                "value": shown,
                "class": code_class(fmt, code),
            }
        )
    return out


def run(args: argparse.Namespace) -> int:
    fmt = get_format(args.format)
    if fmt.bits > MAX_BITS:
        raise UsageError(
            f"{fmt.name} has {fmt.bits} bits ({1 << fmt.bits} codes); `values` lists formats of "
            f"at most {MAX_BITS} bits: use `precisionlab bits` to inspect single values"
        )
    listed = rows(fmt)
    if args.json:
        print(json.dumps(listed, indent=2, allow_nan=False))
        return 0
    color = use_color()
    is_int = isinstance(fmt, IntFormat)
    body = []
    for row in listed:
        value = row["value"]
        exact = value if isinstance(value, str | int) else decimal_str(Decimal(value))
        fields = [] if is_int else [str(row["sign"]), str(row["exponent"]), str(row["mantissa"])]
        body.append(
            [row["hex"], draw_code(fmt, row["code"], color, sep=" "), *fields, exact, row["class"]]
        )
    headers = ["code", "bits"] + ([] if is_int else ["sign", "exponent", "mantissa"])
    headers += ["value", "class"]
    align = "ll" + ("" if is_int else "rrr") + "rl"
    if not is_int and not fmt.signed:  # no sign field
        body = [r[:2] + r[3:] for r in body]
        headers.remove("sign")
        align = "llrrrl"
    layout = "two's complement" if is_int and fmt.signed else "unsigned binary"
    if not is_int:
        layout = ("sign " if fmt.signed else "") + "exponent mantissa"
    print(f"{fmt.name}: {1 << fmt.bits} codes (bits: {layout}; values exact)")
    print(table(body, headers, align=align))
    return 0
