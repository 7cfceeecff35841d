"""Scalar reference codec in plain Python integers and fractions.

Slow and obviously correct: every value is rounded exactly from its rational value, so there
is no double rounding. The vectorized JAX codec in :mod:`precisionlab.bits._codec` is tested
against it (and both against ml_dtypes). The CLI uses it to round decimal input exactly.

Conventions where the formats leave a choice (shared with the vectorized codec):

- NaN into a format without NaN (FP4, FP6, ints) gives +0.
- Overflow: nearest and stochastic rounding go to inf (IEEE), NaN (fn/fnuz), or saturate to
  the largest value (formats with neither); modes that round toward zero for the value's
  sign (``toward_zero``, ``to_odd``, ``up`` for negatives, ``down`` for positives) give the
  largest finite value, as IEEE 754 specifies. ``saturate=True`` always gives +-max.
- Unsigned formats: negative values (and -inf) give NaN where the format has one, else the
  smallest value; ``saturate=True`` gives the smallest value.
- Formats without zero (E8M0): zero gives NaN (as ml_dtypes does) or, with ``saturate=True``,
  the smallest value; positive values below the smallest value become the smallest value.
"""

from __future__ import annotations

import math
import random
from decimal import Decimal
from fractions import Fraction

from precisionlab.bits._rounding import Rounding, parse_rounding
from precisionlab.formats import FloatFormat, Format, IntFormat, Specials, get_format

__all__ = ["decode_scalar", "encode_scalar", "exact_value", "next_down", "next_up"]

Number = int | float | Fraction | Decimal


def exact_value(value: Number) -> tuple[bool, Fraction | float]:
    """``(negative, magnitude)`` of a number: a Fraction, or nan/inf as a float."""
    if isinstance(value, bool):
        raise TypeError("a bool is not a number to encode")
    if isinstance(value, float):
        negative = math.copysign(1.0, value) < 0
        if math.isnan(value) or math.isinf(value):
            return negative, abs(value)
        return negative, abs(Fraction(value))
    if isinstance(value, Decimal):
        negative = value.is_signed()
        if value.is_nan():
            return negative, math.nan
        if value.is_infinite():
            return negative, math.inf
        return negative, abs(Fraction(value))
    if isinstance(value, int | Fraction):
        return value < 0, abs(Fraction(value))
    raise TypeError(
        f"cannot encode a {type(value).__name__}; give an int, float, Fraction or Decimal"
    )


def _floor_log2(a: Fraction) -> int:
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    return e


def _round_integer(
    a: Fraction, negative: bool, mode: Rounding, u: Fraction | None
) -> tuple[int, bool]:
    """Round a non-negative rational to an integer per ``mode``; returns (q, inexact)."""
    q, r = divmod(a.numerator, a.denominator)
    frac = Fraction(r, a.denominator)
    if frac == 0:
        return q, False
    half = Fraction(1, 2)
    if mode is Rounding.NEAREST_EVEN:
        up = frac > half or (frac == half and q % 2 == 1)
    elif mode is Rounding.NEAREST_AWAY:
        up = frac >= half
    elif mode is Rounding.TOWARD_ZERO:
        up = False
    elif mode is Rounding.UP:
        up = not negative
    elif mode is Rounding.DOWN:
        up = negative
    elif mode is Rounding.TO_ODD:
        return q | 1, True
    else:
        if u is None:
            u = Fraction(random.random())
        up = u < frac
    return q + int(up), True


def _toward_zero_for_sign(mode: Rounding, negative: bool) -> bool:
    return (
        mode in (Rounding.TOWARD_ZERO, Rounding.TO_ODD)
        or (mode is Rounding.UP and negative)
        or (mode is Rounding.DOWN and not negative)
    )


def _encode_int(
    negative: bool, a: Fraction | float, fmt: IntFormat, mode: Rounding, u: Fraction | None
) -> int:
    if isinstance(a, float) and math.isnan(a):
        return 0
    if isinstance(a, float):  # inf saturates
        return fmt.code_of(fmt.min if negative else fmt.max)
    q, _ = _round_integer(a, negative, mode, u)
    value = -q if negative else q
    return fmt.code_of(min(max(value, fmt.min), fmt.max))


def _nan_code(fmt: FloatFormat, negative: bool) -> int:
    if not fmt.has_nan:
        return 0
    if fmt.specials is Specials.FNUZ:
        return fmt.sign_mask
    sign = fmt.sign_mask if negative else 0
    top = fmt.exponent_field_max << fmt.mantissa_bits
    if fmt.specials is Specials.FN:
        return sign | top | fmt.mantissa_mask
    return sign | top | (1 << (fmt.mantissa_bits - 1))


def encode_scalar(
    value: Number,
    fmt: Format | str,
    *,
    rounding: str | Rounding = "nearest_even",
    saturate: bool = False,
    subnormals: bool = True,
    u: Fraction | float | None = None,
) -> int:
    """Exact code of ``value`` in ``fmt``.

    Args:
      value: an int, float (nan and +-inf allowed), Fraction or Decimal, rounded exactly.
      fmt: a format or its name.
      rounding: a mode of :class:`~precisionlab.bits._rounding.Rounding`.
      saturate: map out-of-range values and +-inf to +-max (NaN stays NaN where it exists).
      subnormals: if False, results that would be subnormal become zero of the same sign.
      u: for stochastic rounding, the uniform draw in [0, 1) (rounds up iff u < fraction);
        random when omitted.
    """
    fmt = get_format(fmt)
    mode = parse_rounding(rounding)
    # the draw, exact (only stochastic rounding reads it)
    draw = Fraction(u) if mode is Rounding.STOCHASTIC and u is not None else None
    negative, a = exact_value(value)
    if isinstance(fmt, IntFormat):
        return _encode_int(negative, a, fmt, mode, draw)

    sign = fmt.sign_mask if negative else 0
    max_code = fmt.max_code_magnitude
    if isinstance(a, float) and math.isnan(a):
        return _nan_code(fmt, negative)
    if not fmt.signed and negative and (a != 0 or not fmt.has_zero):
        # Unsigned formats hold no negative values (-0 is +0 where there is a zero).
        if saturate or not fmt.has_nan:
            return 0
        return _nan_code(fmt, False)
    if isinstance(a, float):  # infinity
        if saturate or fmt.specials is Specials.NONE:
            return sign | max_code
        if fmt.specials is Specials.IEEE:
            return sign | (fmt.exponent_field_max << fmt.mantissa_bits)
        return _nan_code(fmt, negative)
    if a == 0:
        if not fmt.has_zero:
            return 0 if saturate else _nan_code(fmt, False)
        return 0 if fmt.specials is Specials.FNUZ else sign

    m = fmt.mantissa_bits
    e = _floor_log2(a)
    if not fmt.subnormals and e < fmt.emin:
        return sign | 0  # no zero to round to: the smallest value
    e_q = max(e, fmt.emin) - m  # exponent of the quantum (last significand bit)
    q, _ = _round_integer(a / Fraction(2) ** e_q, negative, mode, draw)
    if fmt.subnormals:
        mag = ((max(e, fmt.emin) - fmt.emin + 1) << m) + q - (1 << m)
    else:
        mag = ((max(e, fmt.emin) - fmt.emin) << m) + q - (1 << m)
    if mag > max_code:
        if saturate or fmt.specials is Specials.NONE or _toward_zero_for_sign(mode, negative):
            return sign | max_code
        if fmt.specials is Specials.IEEE:
            return sign | (fmt.exponent_field_max << m)
        return _nan_code(fmt, negative)
    if fmt.subnormals and not subnormals and mag < (1 << m):
        mag = 0
    if mag == 0 and fmt.specials is Specials.FNUZ:
        return 0
    return sign | mag


def decode_scalar(code: int, fmt: Format | str) -> float:
    """Exact value of ``code`` (a Python float; ints as floats)."""
    return float(get_format(fmt).value_of(code))


def _negate(code: int, fmt: FloatFormat) -> int:
    if fmt.specials is Specials.FNUZ and code & fmt.magnitude_mask == 0:
        return 0  # fnuz has no -0: its code is NaN
    return code ^ fmt.sign_mask


def next_up(code: int, fmt: Format | str) -> int | None:
    """Code of the next larger representable value (toward +inf), or None at the top.

    Zeros step to the smallest positive value; ``next_up`` of the negative value of smallest
    magnitude is ``-0`` where the format has a negative zero, else ``+0``.
    """
    fmt = get_format(fmt)
    if isinstance(fmt, IntFormat):
        n = fmt.value_of(code)
        return fmt.code_of(n + 1) if n < fmt.max else None
    value = fmt.value_of(code)
    if math.isnan(value) or value == math.inf:
        return None
    mag = code & fmt.magnitude_mask
    if value == -math.inf:
        return fmt.sign_mask | fmt.max_code_magnitude
    if value == 0:
        return 1
    if value > 0:
        if mag < fmt.max_code_magnitude:
            return code + 1
        return fmt.inf_codes[0] if fmt.has_inf else None
    if mag == 0:  # signed format without zero: -smallest steps to +smallest
        return 0
    if mag == 1 and fmt.has_zero:
        return fmt.sign_mask if fmt.has_negative_zero else 0
    return code - 1


def next_down(code: int, fmt: Format | str) -> int | None:
    """Code of the next smaller representable value (toward -inf), or None at the bottom."""
    fmt = get_format(fmt)
    if isinstance(fmt, IntFormat):
        n = fmt.value_of(code)
        return fmt.code_of(n - 1) if n > fmt.min else None
    value = fmt.value_of(code)
    if math.isnan(value):
        return None
    if not fmt.signed:
        if value == math.inf:
            return fmt.max_code_magnitude
        return code - 1 if code > 0 else None
    up = next_up(_negate(code, fmt), fmt)
    return None if up is None else _negate(up, fmt)
