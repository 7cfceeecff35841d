"""``precisionlab bits VALUE``: how each format stores a value, bit by bit, exactly.

A decimal VALUE is rounded to each format from its exact decimal value with the scalar
reference codec (Python fractions: no double rounding through float32), and every derived
number (the stored value, its errors, its neighbours) is computed exactly before printing.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, InvalidOperation, localcontext
from fractions import Fraction

from precisionlab.bits._rounding import ROUNDING_MODES
from precisionlab.bits.reference import encode_scalar, next_down, next_up
from precisionlab.cli._common import UsageError, shorten, split_list
from precisionlab.cli._render import (
    bin_code,
    code_class,
    code_fields,
    decimal_str,
    draw_code,
    hex_code,
    paint,
    use_color,
)
from precisionlab.formats import Format, IntFormat, get_format

HELP = "show how each format stores a value: bit fields, code, exact value, error, neighbours"

DEFAULT_FORMATS = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
# A random draw has no place in an exact inspector; up/down show both neighbours.
MODES = tuple(m for m in ROUNDING_MODES if m != "stochastic")

_EPILOG = """\
VALUE is a decimal (0.1, -1.5e-39, 1/3), inf, -inf, nan, -0, or a raw code (0x3c00,
0b0011110000000000) read as a code of each format; without --format a code is shown in the
default formats of its written width (4 hex digits: fp16 and bf16). Values starting with '-'
are taken as VALUE.

value:    the stored value's exact decimal expansion.
short:    its shortest round-trip form: the shortest decimal that encodes back to the same
          code in that format under nearest_even, as a parser reads it (0.1 for bf16's
          0.10009765625; in coarse formats it can differ visibly, e.g. 450 for E4M3's 448).
errors:   |stored - VALUE| (abs), divided by |VALUE| (rel), and in ULPs, where an ULP is the
          gap between consecutive values in the stored value's binade (2^(e - mantissa bits),
          e the stored exponent, emin for zero and subnormals; 1 for integer formats).
"""

# argparse treats any argument that starts with '-' and is not a plain -123 / -1.5 as an
# option; widen its test on this parser so -inf, -nan, -1e-39 and -0x.. reach VALUE.
MAX_EXPONENT = 10_000
MAX_CHARS = 1000
_HUGE_EXPONENT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)e[+-]?\d+$")
_RATIO = re.compile(r"^[+-]?\d+/\d+$")

_NEGATIVE_VALUE = re.compile(r"^-(\d|\.\d|inf|infinity|nan|0x|0b)", re.IGNORECASE)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = _EPILOG
    parser._negative_number_matcher = _NEGATIVE_VALUE  # see _NEGATIVE_VALUE
    parser.add_argument("value", metavar="VALUE", help="a number or a raw code (see below)")
    parser.add_argument(
        "--format",
        "-f",
        default=None,
        metavar="F[,F...]",
        help="formats, comma separated (default: fp32,fp16,bf16,e4m3fn,e5m2)",
    )
    parser.add_argument(
        "--rounding",
        default="nearest_even",
        metavar="MODE",
        help=f"rounding mode: {', '.join(MODES)} (default: nearest_even)",
    )
    parser.add_argument(
        "--saturate", action="store_true", help="clamp out-of-range values and inf to +-max"
    )
    parser.add_argument("--json", action="store_true", help="print a JSON array, one per format")


# --- input ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Parsed:
    """A parsed VALUE: a raw code, or a number (exact Fraction, or a float for 0/inf/nan)."""

    text: str
    code: int | None = None
    number: Fraction | float | None = None


def parse_value(text: str) -> Parsed:
    """Read VALUE: ``0x``/``0b`` codes, ``inf``/``nan`` words, decimals, or ``p/q``."""
    s = text.strip().lower().replace("_", "")
    if len(s) > MAX_CHARS:  # exact arithmetic on a huge literal would take too long
        raise UsageError(
            f"VALUE has {len(s)} characters; at most {MAX_CHARS} are accepted ({shorten(text)!r})"
        )
    if s.startswith(("0x", "0b")):
        try:
            return Parsed(text, code=int(s, 0))
        except ValueError:
            raise UsageError(
                f"{text!r} is not a valid hex (0x...) or binary (0b...) code"
            ) from None
    if s.lstrip("+-").startswith(("0x", "0b")):
        raise UsageError(f"a raw code has no sign: {text!r}; write e.g. 0xbc00 for -1 in fp16")
    if s.lstrip("+-") in ("inf", "infinity", "nan"):
        return Parsed(text, number=float(s))
    try:
        d = Decimal(s)
        if not d.is_finite():
            raise InvalidOperation
        if d != 0 and abs(d.adjusted()) > MAX_EXPONENT:
            # Exact arithmetic on 10**huge would hang; every format is long saturated by then.
            raise UsageError(
                f"{text!r} is out of range: decimal exponents up to +-{MAX_EXPONENT} are accepted"
            )
        # Zero keeps its sign as a float; everything else is an exact Fraction.
        number: Fraction | float = (-0.0 if d.is_signed() else 0.0) if d == 0 else Fraction(d)
        return Parsed(text, number=number)
    except InvalidOperation:
        if _HUGE_EXPONENT.match(s):  # an exponent too large even for Decimal
            raise UsageError(
                f"{shorten(text)!r} is out of range: decimal exponents up to +-{MAX_EXPONENT} "
                "are accepted"
            ) from None
    try:
        # Only p/q here: Fraction also reads exponents Decimal refused (1e10**18), and
        # building 10**(10**18) would hang.
        if not _RATIO.match(s):
            raise ValueError
        return Parsed(text, number=Fraction(s))
    except (ValueError, ZeroDivisionError):
        raise UsageError(
            f"{text!r} is not a number; give a decimal (0.1, -2.5e-3), p/q, inf, -inf, nan, "
            "or a raw code (0x3c00, 0b0011110000000000)"
        ) from None


def parse_formats(text: str | None, parsed: Parsed) -> list[Format]:
    """The formats of ``--format``; without it the defaults, and for a raw code the defaults
    of the code's written width (``0x3c00``: 16 bits), else those wide enough to hold it."""
    if text is None:
        defaults = [get_format(name) for name in DEFAULT_FORMATS]
        if parsed.code is None:
            return defaults
        digits = parsed.text.strip().lower().replace("_", "")
        width = 4 * (len(digits) - 2) if digits.startswith("0x") else len(digits) - 2
        chosen = [f for f in defaults if f.bits == width]
        chosen = chosen or [f for f in defaults if f.bits >= parsed.code.bit_length()]
        if not chosen:
            raise UsageError(f"code {parsed.text} is wider than every default format (32 bits)")
        return chosen
    names = split_list(text)
    if not names:
        raise UsageError("--format needs at least one format name")
    return [get_format(name) for name in names]


def parse_mode(mode: str) -> str:
    key = mode.strip().lower()
    if key == "stochastic":
        raise UsageError(
            "stochastic rounding is random, so `bits` does not show it; use --rounding up and "
            "--rounding down to see both neighbours"
        )
    if key not in MODES:
        raise UsageError(f"unknown rounding mode {mode!r}; allowed: {', '.join(MODES)}")
    return key


# --- exact arithmetic -----------------------------------------------------------------------
# An extended real: a Fraction, or one of the floats inf, -inf, nan.
Ext = Fraction | float


def _exact(fmt: Format, code: int) -> Ext:
    """Value of ``code`` as a Fraction (finite) or float (inf/nan); ``-0`` comes back as -0.0."""
    value = fmt.value_of(code)
    if isinstance(value, int):
        return Fraction(value)
    if not math.isfinite(value) or value == 0:
        return value
    return Fraction(value)


def _abs_error(stored: Ext, given: Ext) -> Ext:
    if _isnan(stored) or _isnan(given):
        return math.nan
    if (isinstance(stored, float) and math.isinf(stored)) or (
        isinstance(given, float) and (math.isinf(given))
    ):
        return Fraction(0) if stored == given else math.inf
    return abs(Fraction(stored) - Fraction(given))


def _isnan(x: Ext) -> bool:
    return isinstance(x, float) and math.isnan(x)


def _rel_error(abs_err: Ext, given: Ext) -> Ext | None:
    if _isnan(abs_err):
        return math.nan
    if isinstance(given, float) and math.isinf(given):
        return Fraction(0) if abs_err == 0 else None  # inf / inf is undefined
    if given == 0:
        return Fraction(0) if abs_err == 0 else None
    if isinstance(abs_err, float):
        return abs_err
    return abs_err / abs(Fraction(given))


def ulp(fmt: Format, code: int) -> Fraction | None:
    """Gap between consecutive values in the binade of ``code`` (None for inf/nan)."""
    if isinstance(fmt, IntFormat):
        return Fraction(1)
    value = fmt.value_of(code)
    if not math.isfinite(value):
        return None
    _, exponent, _ = code_fields(fmt, code)
    assert exponent is not None and fmt.bias is not None  # a float format's field and bias
    e = fmt.emin if (exponent == 0 and fmt.subnormals) else exponent - fmt.bias
    return Fraction(2) ** (e - fmt.mantissa_bits)


def _ulp_error(abs_err: Ext, fmt: Format, code: int) -> Ext:
    if _isnan(abs_err):
        return math.nan
    gap = ulp(fmt, code)
    if gap is None:  # stored inf/nan
        return Fraction(0) if abs_err == 0 else math.inf
    if isinstance(abs_err, float):
        return abs_err
    return abs_err / gap


# --- printing numbers -----------------------------------------------------------------------
def shortest(fmt: Format, code: int) -> str:
    """Shortest decimal that encodes (nearest_even) back to ``code`` in ``fmt``."""
    value = fmt.value_of(code)
    if isinstance(fmt, IntFormat):
        return str(value)
    if math.isnan(value) or math.isinf(value) or value == 0:
        return decimal_str(Decimal(value))
    exact = Decimal(value)  # exact: value_of returns a float that holds the value exactly
    with localcontext() as ctx:
        ctx.prec = 2000
        for digits in range(1, 800):
            quantum = Decimal(1).scaleb(exact.adjusted() - digits + 1)
            candidates = {
                exact.quantize(quantum, ROUND_FLOOR),
                exact.quantize(quantum, ROUND_CEILING),
            }
            hits = [c for c in candidates if encode_scalar(c, fmt) == code]
            if hits:
                best = min(hits, key=lambda c: abs(c - exact))
                return decimal_str(best)
    return decimal_str(exact)


def _neighbour_str(fmt: Format, code: int | None) -> str | None:
    """A neighbour's value: Python's repr of the float64 that holds it exactly, which is
    every digit for formats up to 16 bits (and 17 significant digits beyond)."""
    if code is None:
        return None
    value = fmt.value_of(code)
    if isinstance(value, int) or value.is_integer():
        return str(int(value)) if math.isfinite(value) else decimal_str(Decimal(value))
    return repr(value)


def exact_str(fmt: Format, code: int) -> str:
    """Exact decimal expansion of the value of ``code``."""
    value = fmt.value_of(code)
    return decimal_str(Decimal(value), plain_min=-7, plain_max=40)


def ext_str(x: Ext | None, digits: int = 6) -> str:
    """Short rendering of an exact error (Fractions shown to ``digits`` significant digits)."""
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if x == 0:
        return "0"
    with localcontext() as ctx:
        ctx.prec = digits
        d = Decimal(x.numerator) / Decimal(x.denominator)
    return decimal_str(d, plain_min=-4, plain_max=digits - 1)


def ext_json(x: Ext | None) -> float | str | None:
    """JSON value of an exact number: a float, a string for non-finite values, or null."""
    if x is None:
        return None
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return x
    try:
        as_float = float(x)
    except OverflowError:
        as_float = math.inf
    if math.isinf(as_float) or (as_float == 0 and x != 0):
        return ext_str(x, digits=17)  # beyond float64's range: a decimal string
    return as_float


def value_json(fmt: Format, code: int | None) -> float | int | str | None:
    if code is None:
        return None
    value = fmt.value_of(code)
    if isinstance(value, int):
        return value
    return ext_json(value)


# --- one format -----------------------------------------------------------------------------
def inspect(parsed: Parsed, fmt: Format, rounding: str, saturate: bool) -> dict:
    """Everything `bits` shows for one format, as a JSON-able dict (exact values as strings
    under ``*_exact`` keys)."""
    if parsed.code is not None:
        code = parsed.code
        if code >= 1 << fmt.bits:
            raise UsageError(
                f"code {parsed.text} is wider than {fmt.name} ({fmt.bits} bits: "
                f"codes 0 to {hex_code((1 << fmt.bits) - 1, fmt.bits)})"
            )
        given: Ext = _exact(fmt, code)
    else:
        assert parsed.number is not None  # parse_value gives a code or a number
        given = parsed.number
        code = encode_scalar(given, fmt, rounding=rounding, saturate=saturate)
    stored = _exact(fmt, code)
    abs_err = _abs_error(stored, given)
    rel_err = _rel_error(abs_err, given)
    ulp_err = _ulp_error(abs_err, fmt, code)
    sign, exponent, mantissa = code_fields(fmt, code)
    up, down = next_up(code, fmt), next_down(code, fmt)
    return {
        "format": fmt.name,
        "input": parsed.text,
        "rounding": None if parsed.code is not None else rounding,
        "saturate": saturate,
        "code": code,
        "hex": hex_code(code, fmt.bits),
        "binary": bin_code(code, fmt.bits),
        "sign": sign,
        "exponent": exponent,
        "mantissa": mantissa,
        "value": value_json(fmt, code),
        "shortest": shortest(fmt, code),
        "exact": exact_str(fmt, code),
        "class": code_class(fmt, code),
        "abs_error": ext_json(abs_err),
        "rel_error": ext_json(rel_err),
        "ulp_error": ext_json(ulp_err),
        "ulp": ext_json(ulp(fmt, code)),
        "next_up": value_json(fmt, up),
        "next_down": value_json(fmt, down),
        "next_up_hex": None if up is None else hex_code(up, fmt.bits),
        "next_down_hex": None if down is None else hex_code(down, fmt.bits),
        # exact renderings for the text view
        "_errors": (ext_str(abs_err), ext_str(rel_err), ext_str(ulp_err)),
        "_next": (_neighbour_str(fmt, up), _neighbour_str(fmt, down)),
    }


def _field_legend(fmt: Format) -> str:
    if isinstance(fmt, IntFormat):
        return "sign | value (two's complement)" if fmt.signed else "value"
    parts = (["sign"] if fmt.signed else []) + [f"exponent ({fmt.exponent_bits})"]
    if fmt.mantissa_bits:
        parts.append(f"mantissa ({fmt.mantissa_bits})")
    return " | ".join(parts)


def render(info: dict, fmt: Format, color: bool) -> str:
    """The text block for one format."""
    code = info["code"]
    title = paint(fmt.name, "bold", color)
    how = "code" if info["rounding"] is None else f"{info['rounding']}"
    if info["saturate"]:
        how += ", saturate"
    lines = [f"{title}  ({fmt.bits} bits, {how})"]
    lines.append(f"  bits    {draw_code(fmt, code, color)}    {_field_legend(fmt)}")
    if isinstance(fmt, IntFormat):
        fields = f"two's complement of {fmt.value_of(code)}" if fmt.signed else "unsigned"
    else:
        e_text = f"exponent {info['exponent']}"
        if info["class"] in ("normal", "subnormal"):
            e = fmt.emin if info["class"] == "subnormal" else info["exponent"] - fmt.bias
            e_text += f" (2^{e})"
        sign_text = f"sign {info['sign']}  " if fmt.signed else ""
        fields = f"{sign_text}{e_text}  mantissa {info['mantissa']}"
    lines.append(f"  code    {info['hex']}  {info['binary']}   {fields}")
    lines.append(f"  value   {paint(info['exact'], 'green', color)}   ({info['class']})")
    lines.append(f"  short   {info['shortest']}")
    abs_s, rel_s, ulp_s = info["_errors"]
    lines.append(f"  error   abs {abs_s}   rel {rel_s}   ulp {ulp_s}")
    up_s, down_s = info["_next"]
    up_t = "none" if up_s is None else f"{up_s} ({info['next_up_hex']})"
    down_t = "none" if down_s is None else f"{down_s} ({info['next_down_hex']})"
    lines.append(f"  next    up {up_t}   down {down_t}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    parsed = parse_value(args.value)
    formats = parse_formats(args.format, parsed)
    rounding = parse_mode(args.rounding)
    infos = [inspect(parsed, fmt, rounding, args.saturate) for fmt in formats]
    if args.json:
        public = [{k: v for k, v in info.items() if not k.startswith("_")} for info in infos]
        print(json.dumps(public, indent=2, allow_nan=False))
        return 0
    color = use_color()
    print(f"{parsed.text} ->")
    print("\n\n".join(render(i, f, color) for i, f in zip(infos, formats, strict=True)))
    return 0
