"""The exact reference, vectorized: :func:`precisionlab.bits.reference.encode_scalar` in numpy.

Every step is exact in float64, so no rounding happens before the one being judged:

- ``np.frexp`` gives the exponent of ``|x|`` exactly (``floor(log2|x|)``);
- scaling by a power of two (``np.ldexp``) is exact while the result stays a normal float64,
  which holds here: the scaled significand ``s = |x| / quantum`` lies in ``[2**-1074 * 2**m ..
  2**(m+1))`` for the narrow formats and, for wide ones, is ``>= 2**m``;
- ``s - floor(s)`` is exact (Sterbenz: both operands share a binade, or the floor is 0);
- the decisions (``frac > 0.5``, ``frac == 0.5``, ``frac > 0``) compare exact numbers.

The input is any float64 array (float32, float16 or bfloat16 inputs are first widened, which is
exact). The conventions where formats leave a choice are those of ``bits.reference``. The test
suite checks this module against ``encode_scalar`` exhaustively for every 8-bit and smaller
format from every float16 and bfloat16 value, and on random float64/float32 inputs for every
format and mode; the runner also re-checks each reported disagreement with ``encode_scalar``.
"""

from __future__ import annotations

import functools

import numpy as np
import numpy.typing as npt

from precisionlab.bits._rounding import Rounding, parse_rounding
from precisionlab.bits.reference import encode_scalar
from precisionlab.formats import FloatFormat, Format, Specials, get_format

__all__ = [
    "MODES",
    "as_float_format",
    "decode_codes",
    "encode_exact",
    "is_midpoint",
    "is_nan_code",
    "values_to_codes",
]

#: Deterministic rounding modes the vectorized reference implements (stochastic has no
#: single right answer to compare with).
MODES: tuple[Rounding, ...] = (
    Rounding.NEAREST_EVEN,
    Rounding.NEAREST_AWAY,
    Rounding.TOWARD_ZERO,
    Rounding.UP,
    Rounding.DOWN,
    Rounding.TO_ODD,
)


def as_float_format(fmt: Format | str) -> FloatFormat:
    """The float format named by ``fmt``; ``ValueError`` for integer formats."""
    fmt = get_format(fmt)
    if not isinstance(fmt, FloatFormat):
        raise ValueError(f"conformance covers float formats; {fmt.name} is an integer format")
    if fmt.emin - fmt.mantissa_bits > 0:
        # Scaling tiny inputs down by a positive quantum exponent could leave float64's
        # normal range; no catalog format comes near this.
        raise ValueError(f"{fmt.name}: a smallest quantum above 1 is not supported")
    return fmt


@functools.cache
def _nan_codes(fmt: FloatFormat) -> tuple[int, int]:
    """Codes the reference gives +NaN and -NaN (from the arbiter itself)."""
    return encode_scalar(float("nan"), fmt), encode_scalar(-float("nan"), fmt)


def encode_exact(
    x: npt.ArrayLike,
    fmt: Format | str,
    rounding: str | Rounding = "nearest_even",
    *,
    saturate: bool = False,
) -> np.ndarray:
    """Codes (int64) of the float64 values ``x`` in ``fmt``, exactly as ``encode_scalar``.

    Args:
      x: array-like of floats (widened to float64 exactly); nan and +-inf allowed.
      fmt: a float format (name or object).
      rounding: any deterministic mode of :data:`MODES`.
      saturate: map out-of-range values and +-inf to +-max, as ``encode_scalar``.
    """
    fmt = as_float_format(fmt)
    mode = parse_rounding(rounding)
    if mode not in MODES:
        raise ValueError(f"the exact reference takes {', '.join(MODES)}; got {mode.value!r}")
    x = np.asarray(x, dtype=np.float64)
    m = fmt.mantissa_bits
    neg = np.signbit(x)
    a = np.abs(x)
    nan = np.isnan(x)
    inf = np.isinf(x)
    zero = a == 0
    finite = ~(nan | inf | zero)
    sign = np.where(neg, fmt.sign_mask, 0).astype(np.int64)
    max_code = fmt.max_code_magnitude
    pos_nan, neg_nan = _nan_codes(fmt)

    # Finite nonzero values: a = s * 2**e_q with the integer part of s the candidate code.
    a_safe = np.where(finite, a, 1.0)
    e = np.frexp(a_safe)[1].astype(np.int64) - 1  # floor(log2 a), exact
    e_eff = np.maximum(e, fmt.emin)
    e_q = e_eff - m
    s = np.ldexp(a_safe, (-e_q).astype(np.int32))
    q = np.floor(s)
    frac = s - q
    q = q.astype(np.int64)
    odd = (q & 1) == 1
    if mode is Rounding.NEAREST_EVEN:
        up = (frac > 0.5) | ((frac == 0.5) & odd)
    elif mode is Rounding.NEAREST_AWAY:
        up = frac >= 0.5
    elif mode is Rounding.TOWARD_ZERO:
        up = np.zeros_like(neg)
    elif mode is Rounding.UP:
        up = (frac > 0) & ~neg
    elif mode is Rounding.DOWN:
        up = (frac > 0) & neg
    else:  # to_odd: truncate, then make the last bit 1 when inexact
        up = np.zeros_like(neg)
        q = np.where(frac > 0, q | 1, q)
    q = q + up.astype(np.int64)
    base = (e_eff - fmt.emin + (1 if fmt.subnormals else 0)) << m
    mag = base + q - (1 << m)

    toward_zero = mode in (Rounding.TOWARD_ZERO, Rounding.TO_ODD)
    toward_zero = toward_zero | ((mode is Rounding.UP) & neg) | ((mode is Rounding.DOWN) & ~neg)
    over = mag > max_code
    if saturate or fmt.specials is Specials.NONE:
        over_code = sign | max_code
    elif fmt.specials is Specials.IEEE:
        over_code = np.where(toward_zero, sign | max_code, sign | fmt.inf_codes[0])
    else:
        nan_code = np.where(neg, neg_nan, pos_nan)
        over_code = np.where(toward_zero, sign | max_code, nan_code)
    out = np.where(over, over_code, sign | mag)
    if not fmt.subnormals:
        out = np.where(e < fmt.emin, sign, out)  # below the smallest value: the smallest
    if fmt.specials is Specials.FNUZ:
        out = np.where(finite & ~over & (mag == 0), 0, out)  # no -0: rounds to +0

    # Specials, in the reference's order.
    if fmt.has_zero:
        zero_code = np.zeros_like(sign) if fmt.specials is Specials.FNUZ else sign
    else:
        zero_code = np.full_like(sign, 0 if saturate else pos_nan)
    out = np.where(zero, zero_code, out)
    if saturate or fmt.specials is Specials.NONE:
        inf_code = sign | max_code
    elif fmt.specials is Specials.IEEE:
        inf_code = sign | fmt.inf_codes[0]
    else:
        inf_code = np.where(neg, neg_nan, pos_nan)
    out = np.where(inf, inf_code, out)
    if not fmt.signed:
        # Unsigned formats hold no negative values (-0 is +0 where there is a zero).
        negative = neg & ~nan & (~zero | (not fmt.has_zero))
        out = np.where(negative, 0 if (saturate or not fmt.has_nan) else pos_nan, out)
    out = np.where(nan, np.where(neg, neg_nan, pos_nan), out)
    return out.astype(np.int64)


def is_midpoint(x: npt.ArrayLike, fmt: Format | str) -> np.ndarray:
    """Whether each float64 value lies exactly halfway between two neighbouring values of
    ``fmt`` (with unbounded exponent range, so ``max + ulp(max)/2`` counts), as float64-exact
    as :func:`encode_exact`. Values below the smallest value of a format without zero are not
    midpoints (they have no lower neighbour)."""
    fmt = as_float_format(fmt)
    x = np.asarray(x, dtype=np.float64)
    a = np.abs(x)
    finite = np.isfinite(a) & (a != 0)
    a_safe = np.where(finite, a, 1.0)
    e = np.frexp(a_safe)[1].astype(np.int64) - 1
    e_q = np.maximum(e, fmt.emin) - fmt.mantissa_bits
    s = np.ldexp(a_safe, (-e_q).astype(np.int32))
    half = (s - np.floor(s)) == 0.5
    if not fmt.subnormals:
        half &= e >= fmt.emin
    return finite & half


@functools.cache
def _value_table(fmt: FloatFormat) -> np.ndarray:
    return np.array([fmt.value_of(c) for c in range(1 << fmt.bits)], dtype=np.float64)


def decode_codes(codes: npt.ArrayLike, fmt: Format | str) -> np.ndarray:
    """Exact float64 values of codes (a table for formats of 16 bits or fewer; float32 and
    float64 by bit views). Code -1 (no code) decodes to NaN."""
    fmt = as_float_format(fmt)
    codes = np.asarray(codes, dtype=np.int64)
    bad = codes < 0
    safe = np.where(bad, 0, codes)
    if fmt.bits <= 16:
        out = _value_table(fmt)[safe]
    elif fmt.name == "float32":
        with np.errstate(invalid="ignore"):  # signalling NaN payloads
            out = safe.astype(np.uint32).view(np.float32).astype(np.float64)
    elif fmt.name == "float64":
        out = safe.view(np.float64).copy()
    else:
        out = np.array([fmt.value_of(int(c)) for c in safe], dtype=np.float64)
    return np.where(bad, np.nan, out)


def is_nan_code(codes: npt.ArrayLike, fmt: Format | str) -> np.ndarray:
    """Whether each code (int64, -1 = no code) is a NaN of ``fmt``."""
    fmt = as_float_format(fmt)
    codes = np.asarray(codes, dtype=np.int64)
    return (codes >= 0) & np.isnan(decode_codes(codes, fmt))


def values_to_codes(values: npt.ArrayLike, fmt: Format | str) -> np.ndarray:
    """Codes of values that are exactly values of ``fmt``; -1 where a value is not one (a
    library returned something the format cannot hold, e.g. NaN into FP4)."""
    fmt = as_float_format(fmt)
    values = np.asarray(values, dtype=np.float64)
    codes = encode_exact(values, fmt, Rounding.TOWARD_ZERO)
    back = decode_codes(codes, fmt)
    same = (back == values) & (np.signbit(back) == np.signbit(values))
    if fmt.specials is Specials.FNUZ:
        same |= (values == 0) & (back == 0)  # fnuz has one zero: -0 is stored as +0
    same |= np.isnan(values) & np.isnan(back)
    return np.where(same, codes, -1)
