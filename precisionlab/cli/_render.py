"""Plain-text rendering shared by the CLI commands: aligned tables and optional ANSI colour.

``table(rows, headers)`` lays out cells in columns separated by two spaces, with a dashed rule
under the headers; numbers are right-aligned by default, text left-aligned. Colour is opt-in per
call: :func:`use_color` says whether a stream should get it (a terminal, and ``NO_COLOR``
unset, see https://no-color.org), and :func:`paint` wraps text in an SGR code only when asked.
ANSI codes have zero display width: :func:`visible_len` ignores them when aligning.

Also here, for the commands that show codes: :func:`decimal_str` (every digit of a Decimal),
:func:`number_str` (a compact float), :func:`hex_code`/:func:`bin_code` (zero-padded to the
format's width), :func:`code_fields`, :func:`code_class` and :func:`draw_code` (a code's
sign | exponent | mantissa fields, from plain Python integers), :func:`specials_str`.
"""

from __future__ import annotations

import math
import os
import sys
from decimal import Context, Decimal
from typing import TextIO

from precisionlab._text import table, visible_len
from precisionlab.formats import Format, IntFormat, Specials

__all__ = [
    "STYLES",
    "bin_code",
    "code_class",
    "code_fields",
    "decimal_str",
    "draw_code",
    "hex_code",
    "number_str",
    "paint",
    "specials_str",
    "table",
    "use_color",
    "visible_len",
]

#: SGR parameters of the named styles :func:`paint` accepts.
STYLES: dict[str, str] = {
    "bold": "1",
    "dim": "2",
    "red": "31",
    "green": "32",
    "yellow": "33",
    "blue": "34",
    "magenta": "35",
    "cyan": "36",
}


def use_color(stream: TextIO | None = None) -> bool:
    """True when ``stream`` (default stdout) is a terminal and ``NO_COLOR`` is unset or empty."""
    stream = sys.stdout if stream is None else stream
    if os.environ.get("NO_COLOR"):
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def paint(text: str, style: str, enabled: bool) -> str:
    """``text`` wrapped in the ANSI code of ``style`` (a key of :data:`STYLES`, or several
    joined by '+', e.g. ``"bold+red"``) when ``enabled``; ``text`` unchanged otherwise."""
    if not enabled or not text:
        return text
    try:
        codes = ";".join(STYLES[part] for part in style.split("+"))
    except KeyError as err:
        raise ValueError(f"unknown style {err.args[0]!r}; known: {', '.join(STYLES)}") from None
    return f"\x1b[{codes}m{text}\x1b[0m"


# --- numbers ------------------------------------------------------------------------------
def decimal_str(d: Decimal, *, plain_min: int = -5, plain_max: int = 16) -> str:
    """All digits of a finite Decimal, in plain notation when its leading digit's exponent
    lies in ``[plain_min, plain_max]`` and in scientific notation (``1.5e-45``) otherwise."""
    if not d.is_finite():
        return "nan" if d.is_nan() else ("-inf" if d.is_signed() else "inf")
    if d == 0:
        return "-0" if d.is_signed() else "0"
    # normalize() rounds to the context precision: give it room for every digit.
    d = d.normalize(Context(prec=len(d.as_tuple().digits)))
    sign, digits, _ = d.as_tuple()
    adjusted = d.adjusted()
    if plain_min <= adjusted <= plain_max:
        text = f"{d.copy_abs():f}"
    else:
        mantissa = "".join(map(str, digits))
        if len(mantissa) > 1:
            mantissa = mantissa[0] + "." + mantissa[1:]
        text = f"{mantissa}e{adjusted:+03d}"
    return ("-" if sign else "") + text


def number_str(x: float | int, digits: int = 6) -> str:
    """A compact rendering of a float: ``digits`` significant digits, ``inf``/``nan`` words."""
    if isinstance(x, int):
        return str(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.{digits}g}"


# --- codes ----------------------------------------------------------------------------------
def hex_code(code: int, bits: int) -> str:
    """``0x``-prefixed hex of ``code``, zero-padded to the format's width."""
    return f"0x{code:0{(bits + 3) // 4}x}"


def bin_code(code: int, bits: int) -> str:
    """``0b``-prefixed binary of ``code``, zero-padded to the format's width."""
    return f"0b{code:0{bits}b}"


def code_fields(fmt: Format, code: int) -> tuple[int, int | None, int | None]:
    """``(sign, biased exponent, mantissa)`` fields of ``code``; an int format gives
    ``(sign bit, None, None)`` (sign bit 0 for unsigned ints)."""
    if isinstance(fmt, IntFormat):
        return (code >> (fmt.bits - 1)) & 1 if fmt.signed else 0, None, None
    sign = 1 if code & fmt.sign_mask else 0
    mag = code & fmt.magnitude_mask
    return sign, mag >> fmt.mantissa_bits, mag & fmt.mantissa_mask


def code_class(fmt: Format, code: int) -> str:
    """``"zero"``, ``"subnormal"``, ``"normal"``, ``"inf"`` or ``"nan"`` (ints: ``"zero"`` or
    ``"integer"``), from the format's scalar decoder and fields."""
    value = fmt.value_of(code)
    if isinstance(fmt, IntFormat):
        return "zero" if value == 0 else "integer"
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf"
    if value == 0:
        return "zero"
    _, exponent, _ = code_fields(fmt, code)
    return "subnormal" if fmt.subnormals and exponent == 0 else "normal"


def draw_code(fmt: Format, code: int, color: bool = False, sep: str = " | ") -> str:
    """The bits of ``code`` split as ``sign | exponent | mantissa`` (an int format: sign bit
    and the rest; unsigned formats have no sign field), coloured red/blue/yellow if ``color``."""
    text = f"{code:0{fmt.bits}b}"
    if isinstance(fmt, IntFormat):
        parts = [(text[:1], "red"), (text[1:], "yellow")] if fmt.signed else [(text, "yellow")]
    else:
        s = 1 if fmt.signed else 0
        parts = [(text[:s], "red"), (text[s : s + fmt.exponent_bits], "blue")]
        parts.append((text[s + fmt.exponent_bits :], "yellow"))
    return sep.join(paint(bits, style, color) for bits, style in parts if bits)


def specials_str(fmt: Format) -> str:
    """One phrase for how a format encodes inf and NaN."""
    if isinstance(fmt, IntFormat):
        return "integers (two's complement)" if fmt.signed else "unsigned integers"
    return {
        Specials.IEEE: "ieee: inf and nan",
        Specials.FN: "fn: nan only, no inf",
        Specials.FNUZ: "fnuz: one nan at -0, no inf",
        Specials.NONE: "none: finite only",
    }[fmt.specials]
