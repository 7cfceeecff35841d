"""Vectorized, jittable codecs built from integer and bit operations (and a few float ones).

Every conversion goes through one core, :func:`_pack`: a value given as sign, an unsigned
integer significand ``m`` and a power-of-two exponent ``e2`` (value = m * 2**e2) is rounded
to a target format and packed into its code. Encoding parses the input float's bit pattern
into that form; decoding parses a code of the format and packs it into float32 (or
float64). No float comparison and almost no float arithmetic runs on the codec path: XLA on
CPU flushes float32 subnormals in both, and ``lax.reduce_precision`` only knows IEEE-style
formats. The exceptions, in the nearest-even fast paths from float32: an addition of a
power of two whose unit in the last place is the target's quantum (the FPU then rounds to
nearest-even), whose operands and sum are float32 normals (a flushed float32-subnormal input
rounds to zero either way); and, into small integers, a clamp by float32 compares against
the integer limits, whose outcome flushing cannot change.

The conventions where formats leave a choice are those of :mod:`precisionlab.bits.reference`.
"""

from __future__ import annotations

from enum import IntEnum
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from precisionlab.bits.rounding import Rounding, parse_rounding
from precisionlab.formats import FORMATS, FloatFormat, Format, IntFormat, Specials, get_format

__all__ = [
    "Class",
    "classify",
    "decode",
    "encode",
    "fields",
    "round_to_format",
]

_F32 = FORMATS["float32"]
_F64 = FORMATS["float64"]
_E8M0 = FORMATS["float8_e8m0fnu"]
_SOURCE_FORMATS = {
    jnp.dtype(jnp.float32): _F32,
    jnp.dtype(jnp.float16): FORMATS["float16"],
    jnp.dtype(jnp.bfloat16): FORMATS["bfloat16"],
    jnp.dtype(jnp.float64): _F64,
}


class Class(IntEnum):
    """Class of a code, as returned by :func:`classify`."""

    ZERO = 0
    SUBNORMAL = 1
    NORMAL = 2
    INF = 3
    NAN = 4


class _Parsed(NamedTuple):
    """A decoded value: (-1)**neg * m * 2**e2, or a special. Arrays of one shape.

    ``lead``/``emin`` describe the source when it is a float format: its normal significands
    have their leading bit at ``lead`` and its smallest normal exponent is ``emin``. A target
    whose smallest normal exponent is larger never needs the exact exponent of a source
    subnormal (it is clamped away), which spares a count-leading-zeros per element.
    """

    neg: jax.Array  # bool
    m: jax.Array  # unsigned work dtype; 0 for zeros
    e2: jax.Array  # int32
    nan: jax.Array  # bool
    inf: jax.Array  # bool
    payload: jax.Array  # NaN payload bits aligned to the top of the source mantissa, work dtype
    payload_bits: int  # width of the payload field
    lead: int | None = None
    emin: int | None = None


def _uint(bits: int) -> jnp.dtype:
    return jnp.dtype({8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}[bits])


def _work_dtype(*formats: Format) -> jnp.dtype:
    """uint32 unless a significand of a format needs more (then uint64, which needs x64)."""
    need = 0
    for fmt in formats:
        if isinstance(fmt, FloatFormat):
            need = max(need, fmt.mantissa_bits + 3)
        else:
            need = max(need, fmt.bits + 1)
    if need <= 31:
        return jnp.dtype(jnp.uint32)
    if not jax.config.jax_enable_x64:
        raise ValueError(
            "formats with more than 28 mantissa bits (float64) need 64-bit integers: "
            "enable them with jax.config.update('jax_enable_x64', True)"
        )
    return jnp.dtype(jnp.uint64)


def _shr(x: jax.Array, n: jax.Array) -> jax.Array:
    """Logical right shift that gives 0 for shift counts >= the bit width."""
    width = jnp.iinfo(x.dtype).bits
    n_c = jnp.clip(n, 0, width - 1).astype(x.dtype)
    return jnp.where(n >= width, jnp.zeros_like(x), lax.shift_right_logical(x, n_c))


def _shl(x: jax.Array, n: jax.Array) -> jax.Array:
    """Left shift that gives 0 for shift counts >= the bit width."""
    width = jnp.iinfo(x.dtype).bits
    n_c = jnp.clip(n, 0, width - 1).astype(x.dtype)
    return jnp.where(n >= width, jnp.zeros_like(x), lax.shift_left(x, n_c))


def _const(value: int, dtype) -> jax.Array:
    return jnp.asarray(np.array(value, dtype=dtype))


# --- parsing codes ------------------------------------------------------------------------
def _parse(codes: jax.Array, fmt: Format, work: jnp.dtype) -> _Parsed:
    """Split codes of ``fmt`` into sign, significand and exponent (integer ops only)."""
    c = codes.astype(work)
    if isinstance(fmt, IntFormat):
        if fmt.signed:
            neg = (c >> _const(fmt.bits - 1, work)) & _const(1, work) == _const(1, work)
            mag = jnp.where(neg, (_const((1 << fmt.bits), work) - c), c)
        else:
            neg = jnp.zeros(c.shape, bool)
            mag = c
        false = jnp.zeros(c.shape, bool)
        return _Parsed(neg, mag, jnp.zeros(c.shape, jnp.int32), false, false, jnp.zeros_like(c), 0)

    m_bits = fmt.mantissa_bits
    zero = jnp.zeros_like(c)
    neg = (c & _const(fmt.sign_mask, work)) != zero if fmt.signed else jnp.zeros(c.shape, bool)
    mag = c & _const(fmt.magnitude_mask, work)
    exp_field = (mag >> _const(m_bits, work)).astype(jnp.int32)
    mant = mag & _const(fmt.mantissa_mask, work)
    top = fmt.exponent_field_max
    if fmt.specials is Specials.IEEE:
        special = exp_field == top
        nan = special & (mant != zero)
        inf = special & (mant == zero)
    elif fmt.specials is Specials.FN:
        nan = mag == _const((top << m_bits) | fmt.mantissa_mask, work)
        inf = jnp.zeros(c.shape, bool)
    elif fmt.specials is Specials.FNUZ:
        nan = c == _const(fmt.sign_mask, work)
        inf = jnp.zeros(c.shape, bool)
    else:
        nan = inf = jnp.zeros(c.shape, bool)
    implicit = _const(1 << m_bits, work)
    if fmt.subnormals:
        is_sub = exp_field == 0
        m = jnp.where(is_sub, mant, mant | implicit)
        e2 = jnp.where(is_sub, fmt.emin, exp_field - fmt.bias) - m_bits
    else:
        m = mant | implicit
        e2 = exp_field - fmt.bias - m_bits
    return _Parsed(neg, m, e2.astype(jnp.int32), nan, inf, mant, m_bits, m_bits, fmt.emin)


def _parse_floats(x: jax.Array, work: jnp.dtype) -> _Parsed:
    src = _SOURCE_FORMATS[jnp.dtype(x.dtype)]
    return _parse(lax.bitcast_convert_type(x, _uint(src.bits)), src, work)


# --- rounding and packing -----------------------------------------------------------------
def _round_up(
    q: jax.Array,
    r: jax.Array,
    shift: jax.Array,
    neg: jax.Array,
    mode: Rounding,
    rand: jax.Array | None,
    random_bits: int,
) -> jax.Array:
    """Whether the truncated significand ``q`` with remainder ``r`` (of ``shift`` bits) goes up."""
    one = jnp.ones_like(q)
    inexact = r != 0
    width = jnp.iinfo(q.dtype).bits
    # Significands never use the top bit, so clamping keeps r < half for tiny values.
    half = _shl(one, jnp.minimum(shift - 1, width - 1))  # 0 when shift <= 0, then r == 0
    if mode is Rounding.NEAREST_EVEN:
        return (r > half) | ((r == half) & inexact & ((q & one) == one))
    if mode is Rounding.NEAREST_AWAY:
        return inexact & (r >= half)
    if mode is Rounding.TOWARD_ZERO or mode is Rounding.TO_ODD:
        return jnp.zeros(q.shape, bool)
    if mode is Rounding.UP:
        return inexact & ~neg
    if mode is Rounding.DOWN:
        return inexact & neg
    # Stochastic: up with probability r / 2**shift, the fraction truncated to random_bits.
    frac = jnp.where(shift <= width, _shl(r, width - shift), _shr(r, shift - width))
    frac32 = (frac >> (width - 32)).astype(jnp.uint32) if width > 32 else frac
    drop = 32 - random_bits
    return (rand >> drop) < (frac32 >> drop)


def _pack_int(p: _Parsed, fmt: IntFormat, mode: Rounding, rand, random_bits: int) -> jax.Array:
    work = p.m.dtype
    width = jnp.iinfo(work).bits
    nonzero = p.m != 0
    top = (width - 1) - lax.clz(p.m).astype(jnp.int32)
    # Anything at or above 2**bits saturates; clamp so the shifts below stay in range.
    too_big = nonzero & (p.e2 + top >= fmt.bits)
    shift = jnp.maximum(-p.e2, 0)
    shift_c = jnp.minimum(shift, width - 1)
    q = _shr(p.m, shift_c)
    r = p.m & (_shl(jnp.ones_like(p.m), shift_c) - 1)
    r = jnp.where(shift > shift_c, p.m, r)  # the whole significand is below the quantum
    q = jnp.where(p.e2 > 0, _shl(p.m, p.e2), q)
    up = _round_up(q, r, shift, p.neg, mode, rand, random_bits)
    q = q + up.astype(work)
    if mode is Rounding.TO_ODD:
        q = q | (r != 0).astype(work)
    max_pos = _const(fmt.max, work)
    max_neg = _const(-fmt.min, work)
    q = jnp.where(too_big | p.inf, jnp.where(p.neg, max_neg, max_pos), q)
    q = jnp.where(p.neg, jnp.minimum(q, max_neg), jnp.minimum(q, max_pos))
    q = jnp.where(p.nan, jnp.zeros_like(q), q)
    mask = _const((1 << fmt.bits) - 1, work)
    code = jnp.where(p.neg, (~q + _const(1, work)) & mask, q)
    return code.astype(fmt.code_dtype)


def _pack_float(
    p: _Parsed,
    fmt: FloatFormat,
    mode: Rounding,
    saturate: bool,
    subnormals: bool,
    rand: jax.Array | None,
    random_bits: int,
) -> jax.Array:
    """Round (-1)**neg * m * 2**e2 into ``fmt`` and return its codes."""
    work = p.m.dtype
    width = jnp.iinfo(work).bits
    m_bits = fmt.mantissa_bits
    one = jnp.ones_like(p.m)
    nonzero = p.m != 0

    # Exponent of the leading bit; clamped to the format's range (beyond it is overflow).
    if p.lead is not None and fmt.emin > p.emin:
        lead = p.lead  # a source subnormal is below fmt's range whatever its exponent
    else:
        lead = (width - 1) - lax.clz(p.m).astype(jnp.int32)
    exp = p.e2 + lead
    beyond = nonzero & (exp > fmt.emax + 1)
    exp_c = jnp.clip(exp, fmt.emin, fmt.emax + 1)
    shift = exp_c - m_bits - p.e2  # bits of m below the target's last significand bit
    # Beyond m's width + 2 every remainder is below half: clamping keeps the shifts in range.
    cap = jnp.minimum(shift, width - 2)
    q = jnp.where(shift > 0, _shr(p.m, cap), _shl(p.m, -shift))
    r = jnp.where(shift > 0, p.m & (_shl(one, cap) - 1), jnp.zeros_like(p.m))
    r = jnp.where(shift > cap, p.m, r)
    up = _round_up(q, r, shift, p.neg, mode, rand, random_bits)
    q = q + up.astype(work)
    if mode is Rounding.TO_ODD:
        q = q | (r != 0).astype(work)

    # Code of the magnitude; a carry out of the significand moves to the next binade.
    base = (exp_c - fmt.emin + (1 if fmt.subnormals else 0)).astype(work)
    mag = (base << _const(m_bits, work)) + q - _const(1 << m_bits, work)
    mag = jnp.where(nonzero, mag, jnp.zeros_like(mag))
    below = nonzero & (exp < fmt.emin) if not fmt.subnormals else None
    overflow = beyond | (mag > _const(fmt.max_code_magnitude, work))
    return _finish(mag, overflow, below, nonzero, p, fmt, mode, saturate, subnormals)


def _finish(
    mag: jax.Array,
    overflow: jax.Array,
    below: jax.Array | None,
    nonzero: jax.Array,
    p: _Parsed,
    fmt: FloatFormat,
    mode: Rounding,
    saturate: bool,
    subnormals: bool,
) -> jax.Array:
    """Apply overflow, flushing and the input's specials to a rounded magnitude code.

    ``mag`` is the rounded magnitude code (valid where not ``overflow``); ``below`` marks
    values under the smallest value of a format without zero; ``p`` supplies the sign and
    the input's NaN/inf flags and payload. Shared by the general and the fast paths.
    """
    work = mag.dtype
    m_bits = fmt.mantissa_bits
    max_mag = _const(fmt.max_code_magnitude, work)
    if below is not None:
        overflow = overflow & ~below
    inf_mag = _const(fmt.exponent_field_max << m_bits, work)
    nan_mag = _const(_nan_magnitude(fmt), work)
    false = jnp.zeros(mag.shape, bool)

    # Overflow: +-max when saturating, for formats without specials, and for modes that
    # round toward zero for this sign; otherwise inf, or NaN where there is no inf.
    to_nan = false
    if saturate or fmt.specials is Specials.NONE:
        mag = jnp.where(overflow, max_mag, mag)
    else:
        to_special = overflow & ~_toward_zero(mode, p.neg)
        mag = jnp.where(overflow, max_mag, mag)
        if fmt.has_inf:
            mag = jnp.where(to_special, inf_mag, mag)
        else:
            to_nan = to_special

    if fmt.subnormals and not subnormals:
        mag = jnp.where(mag < _const(1 << m_bits, work), jnp.zeros_like(mag), mag)
    if not fmt.subnormals:  # no zero: values below the smallest become the smallest
        mag = jnp.where(below, jnp.zeros_like(mag), mag)

    # Specials of the input.
    if saturate or fmt.specials is Specials.NONE:
        mag = jnp.where(p.inf, max_mag, mag)
    elif fmt.has_inf:
        mag = jnp.where(p.inf, inf_mag, mag)
    else:
        to_nan = to_nan | p.inf
    sign = jnp.where(p.neg, _const(fmt.sign_mask, work), jnp.zeros_like(mag))
    if fmt.has_nan:
        to_nan = to_nan | p.nan
    else:  # documented choice: NaN into a format without NaN is +0
        mag = jnp.where(p.nan, jnp.zeros_like(mag), mag)
        sign = jnp.where(p.nan, jnp.zeros_like(sign), sign)

    code = sign | mag
    if fmt.specials is Specials.IEEE:
        code = jnp.where(p.nan, sign | nan_mag | _align_payload(p, fmt), code)
    elif fmt.specials is Specials.FN:
        code = jnp.where(to_nan, sign | nan_mag, code)
    elif fmt.specials is Specials.FNUZ:
        code = jnp.where(mag == 0, jnp.zeros_like(code), code)  # no negative zero
        code = jnp.where(to_nan, _const(fmt.sign_mask, work), code)
    if not fmt.signed:
        invalid = p.neg & ~p.nan & (nonzero | p.inf | (not fmt.has_zero))
        low = jnp.zeros_like(code)
        code = jnp.where(invalid, low if saturate or not fmt.has_nan else nan_mag, code)
    if not fmt.has_zero:
        zero_in = ~nonzero & ~p.nan & ~p.inf
        code = jnp.where(zero_in, jnp.zeros_like(code) if saturate else nan_mag, code)
    return code.astype(fmt.code_dtype)


def _nan_magnitude(fmt: FloatFormat) -> int:
    if fmt.specials is Specials.IEEE:
        return (fmt.exponent_field_max << fmt.mantissa_bits) | (1 << (fmt.mantissa_bits - 1))
    if fmt.specials is Specials.FN:
        return (fmt.exponent_field_max << fmt.mantissa_bits) | fmt.mantissa_mask
    return 0  # fnuz NaN is the sign-only code, set separately; none has no NaN


def _align_payload(p: _Parsed, fmt: FloatFormat) -> jax.Array:
    """Keep the top bits of a NaN's payload (as IEEE conversions do)."""
    diff = p.payload_bits - fmt.mantissa_bits
    if diff >= 0:
        dtype = p.payload.dtype
        return (p.payload >> _const(diff, dtype)) & _const(fmt.mantissa_mask, dtype)
    return p.payload << _const(-diff, p.payload.dtype)


def _toward_zero(mode: Rounding, neg: jax.Array) -> jax.Array | bool:
    if mode in (Rounding.TOWARD_ZERO, Rounding.TO_ODD):
        return jnp.ones(neg.shape, bool)
    if mode is Rounding.UP:
        return neg
    if mode is Rounding.DOWN:
        return ~neg
    return jnp.zeros(neg.shape, bool)


def _pack(p: _Parsed, fmt: Format, mode: Rounding, saturate, subnormals, rand, random_bits):
    if isinstance(fmt, IntFormat):
        return _pack_int(p, fmt, mode, rand, random_bits)
    return _pack_float(p, fmt, mode, saturate, subnormals, rand, random_bits)


# --- public API -----------------------------------------------------------------------------
def _check_input(x) -> jax.Array:
    if isinstance(x, bool):
        raise TypeError("encode takes floating-point values, got a bool")
    if isinstance(x, int | float):
        x = jnp.asarray(x, dtype=jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)
    x = jnp.asarray(x)
    if jnp.dtype(x.dtype) not in _SOURCE_FORMATS:
        raise TypeError(
            f"encode takes float32, float16, bfloat16 or (with jax_enable_x64) float64 "
            f"arrays, got {x.dtype}; cast explicitly first"
        )
    return x


@partial(jax.jit, static_argnames=("fmt", "mode", "saturate", "subnormals", "random_bits"))
def _encode(x, key, *, fmt, mode, saturate, subnormals, random_bits):
    src = _SOURCE_FORMATS[jnp.dtype(x.dtype)]
    if _same_exponent_field(src, fmt) and mode is not Rounding.STOCHASTIC:
        return _encode_same_exponent(x, src, fmt, mode, saturate, subnormals)
    if _narrow_from_float32(src, fmt) and mode is not Rounding.STOCHASTIC:
        if mode is Rounding.NEAREST_EVEN and subnormals and _nearest_even_applies(fmt):
            return _encode_narrow_nearest_even(x, fmt, saturate)
        return _encode_narrow(x, fmt, mode, saturate, subnormals)
    if src is _F32 and fmt == _E8M0 and mode is Rounding.NEAREST_EVEN and subnormals:
        return _encode_e8m0_nearest_even(x, saturate)
    if src is _F32 and isinstance(fmt, IntFormat) and fmt.bits <= 16:
        if mode is Rounding.NEAREST_EVEN:
            return _encode_small_int_nearest_even(x, fmt)
        if mode is not Rounding.STOCHASTIC:
            return _encode_small_int(x, fmt, mode)
    work = _work_dtype(src, fmt)
    p = _parse_floats(x, work)
    rand = jax.random.bits(key, x.shape, jnp.uint32) if mode is Rounding.STOCHASTIC else None
    return _pack(p, fmt, mode, saturate, subnormals, rand, random_bits)


def _apply_rounding(q, r, half, neg, mode: Rounding) -> jax.Array:
    """Round the truncated significand ``q`` given its remainder ``r`` and the remainder of
    one half quantum ``half`` (deterministic modes; same dtype throughout)."""
    one = jnp.ones_like(q)
    if mode is Rounding.NEAREST_EVEN:
        return q + ((r > half) | ((r == half) & ((q & one) == one))).astype(q.dtype)
    if mode is Rounding.NEAREST_AWAY:
        return q + (r >= half).astype(q.dtype)
    if mode is Rounding.UP:
        return q + ((r != 0) & ~neg).astype(q.dtype)
    if mode is Rounding.DOWN:
        return q + ((r != 0) & neg).astype(q.dtype)
    if mode is Rounding.TO_ODD:
        return q | (r != 0).astype(q.dtype)
    return q  # toward_zero


def _same_exponent_field(src: FloatFormat, fmt: Format) -> bool:
    """Whether fmt is src with a shorter mantissa (float32 -> bfloat16, tf32)."""
    return (
        isinstance(fmt, FloatFormat)
        and fmt.specials is Specials.IEEE
        and src.specials is Specials.IEEE
        and fmt.signed
        and fmt.subnormals
        and fmt.exponent_bits == src.exponent_bits
        and fmt.bias == src.bias
        and fmt.mantissa_bits < src.mantissa_bits
    )


def _encode_same_exponent(x, src: FloatFormat, fmt: FloatFormat, mode, saturate, subnormals):
    """Fast path: dropping mantissa bits is one shift of the magnitude, with rounding.

    A carry out of the mantissa moves into the exponent field and past the largest finite
    value into the inf code, as the general path would; NaN keeps its top payload bits and
    gets the quiet bit. Same results as :func:`_pack_float` (checked exhaustively by the
    tests, which go through :func:`encode`).
    """
    work = _uint(src.bits)
    u = lax.bitcast_convert_type(x, work)
    drop = src.mantissa_bits - fmt.mantissa_bits
    mag = u & _const(src.magnitude_mask, work)
    neg = (u >> _const(src.bits - 1, work)) != 0
    if mode is Rounding.NEAREST_EVEN:  # the common case, in fewer operations
        q = _round_shift_even(mag, drop)
    else:
        q = mag >> _const(drop, work)
        r = mag & _const((1 << drop) - 1, work)
        q = _apply_rounding(q, r, _const(1 << (drop - 1), work), neg, mode)
    inf_mag = _const(fmt.exponent_field_max << fmt.mantissa_bits, work)
    max_mag = _const(fmt.max_code_magnitude, work)
    src_inf = _const(src.exponent_field_max << src.mantissa_bits, work)
    is_nan = mag > src_inf
    if saturate:
        q = jnp.where(q >= inf_mag, max_mag, q)
    elif mode in (Rounding.TOWARD_ZERO, Rounding.TO_ODD, Rounding.UP, Rounding.DOWN):
        # Directed modes overflow to the largest finite value toward zero (IEEE 754).
        toward_zero = _toward_zero(mode, neg)
        q = jnp.where((q >= inf_mag) & (mag < src_inf) & toward_zero, max_mag, q)
    if not subnormals:
        q = jnp.where(q < _const(1 << fmt.mantissa_bits, work), jnp.zeros_like(q), q)
    quiet = _const(1 << (fmt.mantissa_bits - 1), work)
    q = jnp.where(is_nan, (mag >> _const(drop, work)) | quiet, q)
    sign = (u >> _const(src.bits - fmt.bits, work)) & _const(fmt.sign_mask, work)
    return (q | sign).astype(fmt.code_dtype)


def _narrow_from_float32(src: FloatFormat, fmt: Format) -> bool:
    """Whether the float32 fast path applies: a signed format with subnormals whose range
    lies inside float32's normal range (float16, the FP8, FP6 and FP4 formats)."""
    return (
        src is _F32
        and isinstance(fmt, FloatFormat)
        and fmt.signed
        and fmt.subnormals
        and fmt.mantissa_bits <= 22
        and fmt.emin > _F32.emin
        and fmt.emax <= _F32.emax
    )


def _encode_narrow(x, fmt: FloatFormat, mode, saturate, subnormals):
    """Fast path float32 -> narrower float: the input's exponent is read off its bits.

    A result in fmt's normal range is float32's magnitude re-biased: one shift by
    ``23 - m`` with rounding, then a subtraction of the bias difference (a carry moves into
    the next binade). A result in fmt's subnormal range shifts the significand by one more
    bit per binade below fmt's smallest normal. Both share one rounding step and the tail of
    the general path (:func:`_finish`), so the conventions are the same by construction.
    """
    work = jnp.dtype(jnp.uint32)
    m = fmt.mantissa_bits
    u = lax.bitcast_convert_type(x, work)
    a = u & _const(0x7FFFFFFF, work)
    neg = (u >> _const(31, work)) != 0
    exp_field = a >> _const(23, work)
    normal_floor = _const((127 + fmt.emin) << 23, work)  # bits of fmt's smallest normal
    is_sub = a < normal_floor
    significand = jnp.where(
        exp_field == 0, a, (a & _const(0x7FFFFF, work)) | _const(0x800000, work)
    )
    # Bits below fmt's last significand bit: 23 - m for normal results, more below them.
    sub_shift = jnp.minimum(
        _const(150 + fmt.emin - m, work) - jnp.maximum(exp_field, _const(1, work)),
        _const(31, work),
    )
    value = jnp.where(is_sub, significand, a)
    shift = jnp.where(is_sub, sub_shift, _const(23 - m, work))
    q = value >> shift
    r = value & ((_const(1, work) << shift) - _const(1, work))
    half = _const(1, work) << (shift - _const(1, work))
    q = _apply_rounding(q, r, half, neg, mode)
    rebias = _const((127 - fmt.bias) << m, work)
    mag = jnp.where(is_sub, q, q - rebias)
    inf_bits = _const(0x7F800000, work)
    p = _Parsed(
        neg=neg,
        m=a,
        e2=None,
        nan=a > inf_bits,
        inf=a == inf_bits,
        payload=a & _const(0x7FFFFF, work),
        payload_bits=23,
    )
    overflow = ~is_sub & (mag > _const(fmt.max_code_magnitude, work))
    return _finish(mag, overflow, None, a != 0, p, fmt, mode, saturate, subnormals)


def _round_shift_even(v: jax.Array, shift: int, offset: int = 0) -> jax.Array:
    """``(v + offset) >> shift`` rounded to nearest, ties to even (``shift`` >= 1 and
    ``offset`` a multiple of ``2**(shift + 1)``, static; unsigned ``v`` with room for the carry,
    arithmetic modulo the dtype's width): adding half a quantum less one, plus the parity
    of the result, carries exactly when the dropped bits exceed half or equal it at an odd
    result."""
    dtype = v.dtype
    width = jnp.iinfo(dtype).bits
    odd = (v >> _const(shift, dtype)) & _const(1, dtype)
    add = (offset + (1 << (shift - 1)) - 1) % (1 << width)
    return (v + _const(add, dtype) + odd) >> _const(shift, dtype)


def _nearest_even_applies(fmt: FloatFormat) -> bool:
    """Formats whose overflow, inf and NaN codes :func:`_encode_narrow_nearest_even` gets
    from one ``min`` and one NaN select: IEEE, FN (NaN is the code after the largest), none."""
    if fmt.specials is Specials.FN:
        return _nan_magnitude(fmt) == fmt.max_code_magnitude + 1
    return fmt.specials in (Specials.IEEE, Specials.NONE)


def _encode_narrow_nearest_even(x, fmt: FloatFormat, saturate: bool) -> jax.Array:
    """Fastest path, float32 -> narrower float, nearest-even with subnormals (the default).

    Normal results: float32's magnitude rounded at bit ``23 - m`` (:func:`_round_shift_even`)
    and re-biased; a carry moves into the next binade and past the largest finite value.
    Subnormal results (|x| below fmt's smallest normal): one float32 addition of
    ``2**(emin - m + 23)``, whose unit in the last place is fmt's subnormal quantum, so the
    FPU rounds to nearest-even and the sum's low bits are the code. The only float operation
    on the codec path: its operands and sum are float32 normals, except float32-subnormal
    inputs, which XLA may flush to zero, harmlessly: they round to zero either way.
    Overflow, inf and NaN: magnitudes above the largest code clamp to inf (IEEE), to the NaN
    code that follows the largest finite one (FN) or to the largest value (saturating, or
    formats without specials); NaN inputs are then selected. Same codes as
    :func:`_encode_narrow` (checked over all 2**32 inputs by the tests).
    """
    work = jnp.dtype(jnp.uint32)
    m = fmt.mantissa_bits
    u = lax.bitcast_convert_type(x, work)
    a = u & _const(0x7FFFFFFF, work)
    # Re-biased before the shift (one add fewer): the sum wraps only where |x| is below
    # fmt's normal range, and those lanes take the subnormal result.
    norm = _round_shift_even(a, 23 - m, offset=-((127 - fmt.bias) << 23))
    magic = (127 + fmt.emin - m + 23) << 23  # bits of 2**(emin - m + 23)
    total = lax.bitcast_convert_type(a, jnp.float32) + np.float32(2.0 ** (fmt.emin - m + 23))
    sub = lax.bitcast_convert_type(total, work) - _const(magic, work)
    mag = jnp.where(a < _const((127 + fmt.emin) << 23, work), sub, norm)
    if saturate or fmt.specials is Specials.NONE:
        top = fmt.max_code_magnitude
    elif fmt.specials is Specials.IEEE:
        top = fmt.exponent_field_max << m  # inf
    else:
        top = _nan_magnitude(fmt)  # FN: overflow and inf become NaN
    mag = jnp.minimum(mag, _const(top, work))
    sign = (u >> _const(32 - fmt.bits, work)) & _const(fmt.sign_mask, work)
    code = sign | mag
    is_nan = a > _const(0x7F800000, work)
    if fmt.specials is Specials.IEEE:  # quiet NaN keeping the top payload bits
        payload = (a & _const(0x7FFFFF, work)) >> _const(23 - m, work)
        code = jnp.where(is_nan, sign | _const(_nan_magnitude(fmt), work) | payload, code)
    elif fmt.specials is Specials.FN:
        if saturate:  # otherwise NaN's magnitude, above every finite one, clamped to NaN
            code = jnp.where(is_nan, sign | _const(_nan_magnitude(fmt), work), code)
    else:  # documented choice: NaN into a format without NaN is +0
        code = jnp.where(is_nan, jnp.zeros_like(code), code)
    return code.astype(fmt.code_dtype)


def _encode_small_int(x, fmt: IntFormat, mode: Rounding) -> jax.Array:
    """Fast path float32 -> integers of at most 16 bits: round the significand at the
    binary point (its position read off the exponent field), saturate, two's complement.

    Magnitudes of 2**23 and more are integers beyond every such format's range, so they
    saturate without rounding; NaN gives 0, as on the general path.
    """
    work = jnp.dtype(jnp.uint32)
    u = lax.bitcast_convert_type(x, work)
    a = u & _const(0x7FFFFFFF, work)
    neg = (u >> _const(31, work)) != 0
    exp_field = a >> _const(23, work)
    significand = jnp.where(
        exp_field == 0, a, (a & _const(0x7FFFFF, work)) | _const(0x800000, work)
    )
    # value = significand * 2**(exp_field - 150): bits below the binary point.
    shift = jnp.clip(
        _const(150, work) - jnp.maximum(exp_field, _const(1, work)),
        _const(1, work),
        _const(31, work),
    )
    q = significand >> shift
    r = significand & ((_const(1, work) << shift) - _const(1, work))
    half = _const(1, work) << (shift - _const(1, work))
    q = _apply_rounding(q, r, half, neg, mode)
    one = _const(1, work)
    limit = jnp.where(neg, _const(-fmt.min, work), _const(fmt.max, work))
    big = a >= _const(150 << 23, work)  # |x| >= 2**23, inf included
    q = jnp.where(big, limit, jnp.minimum(q, limit))
    q = jnp.where(a > _const(0x7F800000, work), jnp.zeros_like(q), q)  # NaN -> 0
    mask = _const((1 << fmt.bits) - 1, work)
    code = jnp.where(neg, (~q + one) & mask, q)
    return code.astype(fmt.code_dtype)


def _encode_e8m0_nearest_even(x, saturate: bool) -> jax.Array:
    """Fast path float32 -> E8M0 (unsigned powers of two 2**-127 .. 2**127, code 255 NaN),
    nearest-even: float32's bits rounded at the exponent field give the code directly. A
    tie, 1.5 * 2**k, goes up: 2**(k + 1) is the even multiple of 2**k. Float32 subnormals
    lie between 2**-127 (code 0) and 2**-126 (code 1), whose midpoint is the pattern
    0x600000.
    Conventions as on the general path (same codes over all 2**32 inputs, by the tests):
    overflow and inf give NaN (the largest value when saturating), zeros and negative
    values NaN (code 0, the smallest value, when saturating), NaN stays NaN.
    """
    work = jnp.dtype(jnp.uint32)
    u = lax.bitcast_convert_type(x, work)
    if not saturate:  # the default, in 10 operations instead of 15
        return _encode_e8m0_nearest_even_nan(u)
    a = u & _const(0x7FFFFFFF, work)
    code = (a + _const(0x400000, work)) >> _const(23, work)
    code = jnp.where(a < _const(0x800000, work), (a >= _const(0x600000, work)).astype(work), code)
    nan = _const(0xFF, work)
    code = jnp.minimum(code, _const(0xFE, work) if saturate else nan)
    invalid = (u > _const(0x7FFFFFFF, work)) | (a == 0)  # negative, or a zero
    code = jnp.where(invalid, jnp.zeros_like(code) if saturate else nan, code)
    code = jnp.where(a > _const(0x7F800000, work), nan, code)
    return code.astype(jnp.uint8)


def _encode_e8m0_nearest_even_nan(u: jax.Array) -> jax.Array:
    """:func:`_encode_e8m0_nearest_even` without saturation, from float32 bits ``u``.

    ``((u >> 22) + 1) >> 1`` is the exponent field rounded half up at its top mantissa bit
    for positive values; with the sign bit in it, every negative input (NaN, zeros and -inf
    included) lands above 255, so one ``min`` gives NaN (255) for them, for overflow, inf
    and positive NaN. Two selects remain: positive float32 subnormals in [2**-127, 1.5 *
    2**-127) (``u >> 21 == 2``) round down to code 0, not up, and +0 is NaN.
    """
    work = u.dtype
    code = ((u >> _const(22, work)) + _const(1, work)) >> _const(1, work)
    code = jnp.minimum(code, _const(0xFF, work))
    code = jnp.where(u >> _const(21, work) == _const(2, work), jnp.zeros_like(code), code)
    code = jnp.where(u == _const(0, work), _const(0xFF, work), code)
    return code.astype(jnp.uint8)


def _encode_small_int_nearest_even(x, fmt: IntFormat) -> jax.Array:
    """Fastest path float32 -> integers of at most 16 bits, nearest-even (the default).

    x is clamped to [min, max] in float32 (two compares and selects; NaN is selected to 0 at
    the end), then 1.5 * 2**23 is added: the sum has a unit in the last place of 1, so the
    FPU rounds to the nearest integer, ties to even, and the low bits of the sum are that
    integer in two's complement (for any |value| < 2**22). Rounding after the clamp equals
    rounding then saturating, since min and max are integers. Same codes as
    :func:`_encode_small_int` (checked over all 2**32 inputs by the tests). Float32-subnormal
    inputs, which XLA may flush to zero, round to zero either way. Seven operations per
    element, against fifteen for the same rounding on the integer bits.
    """
    work = jnp.dtype(jnp.uint32)
    lo, hi = np.float32(fmt.min), np.float32(fmt.max)
    # where(x > lo, x, lo) rather than maximum: XLA's NaN-propagating max costs more, and a
    # NaN lane is overwritten below anyway.
    y = jnp.where(x > lo, x, lo)
    y = jnp.where(y < hi, y, hi)
    code = lax.bitcast_convert_type(y + np.float32(1.5 * 2.0**23), work)
    is_nan = (lax.bitcast_convert_type(x, work) << _const(1, work)) > _const(0xFF000000, work)
    code = jnp.where(is_nan, jnp.zeros_like(code), code)
    if fmt.bits not in (8, 16):  # otherwise the cast to the code dtype drops the high bits
        code = code & _const((1 << fmt.bits) - 1, work)
    return code.astype(fmt.code_dtype)


def _decode_to_float32_fast(codes, fmt: FloatFormat) -> jax.Array:
    """Fast decode into float32 for formats whose nonzero finite values are float32 normals.

    Normal codes are re-biased (one shift and one add); subnormal codes are small integers
    (converted to float32 exactly, then their exponent field lowered); same-exponent formats
    (bfloat16, tf32) are one shift.
    """
    work = jnp.dtype(jnp.uint32)
    c = codes.astype(work)
    m = fmt.mantissa_bits
    if fmt.exponent_bits == 8 and fmt.bias == 127 and fmt.specials is Specials.IEEE:
        return lax.bitcast_convert_type(c << _const(32 - fmt.bits, work), jnp.float32)
    mag = c & _const(fmt.magnitude_mask, work)
    sign = (c & _const(fmt.sign_mask, work)) << _const(32 - fmt.bits, work)
    bits = (mag << _const(23 - m, work)) + _const((127 - fmt.bias) << 23, work)
    if fmt.subnormals:
        mant = mag & _const(fmt.mantissa_mask, work)
        exact = lax.bitcast_convert_type(mant.astype(jnp.int32).astype(jnp.float32), work)
        sub_bits = exact - _const((m - fmt.emin) << 23, work)
        is_sub = mag < _const(1 << m, work)
        bits = jnp.where(is_sub, jnp.where(mag == 0, jnp.zeros_like(bits), sub_bits), bits)
    quiet_nan = _const(0x7FC00000, work)
    if fmt.specials is Specials.IEEE:
        top = _const(fmt.exponent_field_max << m, work)
        payload = (mag & _const(fmt.mantissa_mask, work)) << _const(23 - m, work)
        bits = jnp.where(mag >= top, _const(0x7F800000, work) | payload, bits)
    elif fmt.specials is Specials.FN:
        bits = jnp.where(mag == _const(fmt.magnitude_mask, work), quiet_nan, bits)
    elif fmt.specials is Specials.FNUZ:
        bits = jnp.where(c == _const(fmt.sign_mask, work), quiet_nan, bits)
    return lax.bitcast_convert_type(bits | sign, jnp.float32)


def _fast_decode_applies(fmt: Format, dtype) -> bool:
    if jnp.dtype(dtype) != jnp.float32 or not isinstance(fmt, FloatFormat):
        return False
    if fmt.mantissa_bits > 23 or fmt.emax > _F32.emax:
        return False
    if fmt.exponent_bits == 8 and fmt.bias == 127 and fmt.specials is Specials.IEEE:
        return fmt.signed  # bfloat16, tf32: a shift
    smallest = fmt.emin - fmt.mantissa_bits if fmt.subnormals else fmt.emin
    return smallest >= _F32.emin and (fmt.subnormals or fmt.specials is not Specials.FNUZ)


def encode(
    x,
    fmt: Format | str,
    *,
    rounding: str | Rounding = "nearest_even",
    saturate: bool = False,
    subnormals: bool = True,
    key: jax.Array | None = None,
    random_bits: int | None = None,
) -> jax.Array:
    """Bit patterns of ``x`` stored in ``fmt``.

    Args:
      x: float32, float16 or bfloat16 array (upcast exactly), or float64 with
        ``jax_enable_x64`` (encoded from its own bits, no double rounding). Python scalars
        become float32 (float64 under x64) first.
      fmt: a format or its name; static.
      rounding: one of :data:`~precisionlab.bits.rounding.ROUNDING_MODES`; static.
      saturate: map out-of-range values and +-inf to +-max; NaN stays NaN where it exists.
      subnormals: if False, results that would be subnormal become zero of the same sign.
      key: PRNG key, required by ``rounding="stochastic"``.
      random_bits: random bits per element for stochastic rounding (1..32, default 32); the
        fractional distance is truncated to this many bits, as hardware does.

    Returns:
      Codes with ``x``'s shape, dtype ``fmt.code_dtype`` (uint8, uint16 or uint32). Integer
      formats hold two's-complement codes (int4 -1 is 0xF) of the rounded, saturated value.

    Example:
      float8_e4m3fn has no infinity: 500 overflows to NaN (0x7f), or saturates to 448 (0x7e).

      >>> import jax.numpy as jnp
      >>> from precisionlab import encode
      >>> x = jnp.array([1.0, -2.0, 0.1, 500.0])
      >>> [hex(c) for c in encode(x, "e4m3").tolist()]
      ['0x38', '0xc0', '0x1d', '0x7f']
      >>> [hex(c) for c in encode(x, "e4m3", saturate=True).tolist()]
      ['0x38', '0xc0', '0x1d', '0x7e']
    """
    fmt = get_format(fmt)
    mode = parse_rounding(rounding)
    x = _check_input(x)
    if mode is Rounding.STOCHASTIC:
        if key is None:
            raise ValueError("rounding='stochastic' needs a PRNG key: pass key=jax.random.key(0)")
        bits = 32 if random_bits is None else random_bits
        if not isinstance(bits, int) or not 1 <= bits <= 32:
            raise ValueError(f"random_bits must be an int from 1 to 32, got {random_bits!r}")
    else:
        if key is not None:
            raise ValueError(f"key is only used by rounding='stochastic', not {mode.value!r}")
        bits = 32
    return _encode(
        x,
        key,
        fmt=fmt,
        mode=mode,
        saturate=bool(saturate),
        subnormals=bool(subnormals),
        random_bits=bits,
    )


def _decode_e8m0_to_float32(codes) -> jax.Array:
    """E8M0 code c is 2**(c - 127): float32's exponent field, except 2**-127 (code 0), a
    float32 subnormal, and 255, NaN (quiet, positive, as on the general path). Both are the
    shifted code with the bit 0x400000 set: it is set without a select, from one uint8 test
    (c - 1 wraps code 0 to 255); faster than two selects on the float32 bits in interleaved
    timings (uint8 codes, as :func:`_decode` passes them)."""
    work = jnp.dtype(jnp.uint32)
    c = codes.astype(jnp.uint8)
    special = (c - np.uint8(1)) >= np.uint8(254)  # codes 0 and 255
    bits = (c.astype(work) << _const(23, work)) | (special.astype(work) << _const(22, work))
    return lax.bitcast_convert_type(bits, jnp.float32)


def _decode_small_int_to_float32(codes, fmt: IntFormat) -> jax.Array:
    """Integer codes of at most 24 bits into float32: sign-extend the two's complement code
    (shift it to the top of an int32 and back) and convert; every such integer is a float32,
    so the conversion is exact, and zero is +0 as on the general path."""
    c = codes.astype(jnp.uint32)
    if fmt.signed:
        up = _const(32 - fmt.bits, jnp.uint32)
        v = lax.shift_right_arithmetic(
            lax.bitcast_convert_type(c << up, jnp.int32), up.astype(jnp.int32)
        )
    else:
        v = c.astype(jnp.int32)
    return v.astype(jnp.float32)


@partial(jax.jit, static_argnames=("fmt", "dtype"))
def _decode(codes, *, fmt, dtype):
    # Masked inside the jit: outside, it would be one more whole-array buffer and pass.
    mask = (1 << fmt.bits) - 1
    codes = codes.astype(fmt.code_dtype) & np.array(mask, dtype=fmt.code_dtype)
    if _fast_decode_applies(fmt, dtype):
        return _decode_to_float32_fast(codes, fmt)
    if fmt == _E8M0 and jnp.dtype(dtype) == jnp.float32:
        return _decode_e8m0_to_float32(codes)
    if isinstance(fmt, IntFormat) and fmt.bits <= 24 and jnp.dtype(dtype) == jnp.float32:
        return _decode_small_int_to_float32(codes, fmt)
    out = _SOURCE_FORMATS[jnp.dtype(dtype)]
    work = _work_dtype(fmt, out)
    p = _parse(codes, fmt, work)
    bits = _pack(p, out, Rounding.NEAREST_EVEN, False, True, None, 32)
    return lax.bitcast_convert_type(bits, jnp.dtype(dtype))


def _check_codes(codes, fmt: Format) -> jax.Array:
    codes = jnp.asarray(codes)
    if not jnp.issubdtype(codes.dtype, jnp.integer):
        raise TypeError(f"codes must be an integer array, got {codes.dtype}")
    return codes


def decode(codes, fmt: Format | str, *, dtype=jnp.float32) -> jax.Array:
    """Values of the codes of ``fmt``.

    Args:
      codes: integer array of codes (only the low ``fmt.bits`` bits are read).
      fmt: a format or its name; static.
      dtype: float32 (default), float64 (needs ``jax_enable_x64``; exact for every format),
        float16 or bfloat16. Values that the dtype cannot hold are rounded to nearest even.

    Returns:
      An array of ``dtype`` with the codes' shape; integer formats give their integer value.

    Example:
      >>> import jax.numpy as jnp
      >>> from precisionlab import decode
      >>> decode(jnp.array([0x38, 0xC0, 0x1D, 0x7E, 0x7F], jnp.uint8), "e4m3").tolist()
      [1.0, -2.0, 0.1015625, 448.0, nan]
    """
    fmt = get_format(fmt)
    dtype = jnp.dtype(dtype)
    if dtype not in _SOURCE_FORMATS:
        raise ValueError(f"decode produces float32, float64, float16 or bfloat16, not {dtype}")
    if dtype == jnp.float64 and not jax.config.jax_enable_x64:
        raise ValueError("decode to float64 needs jax.config.update('jax_enable_x64', True)")
    return _decode(_check_codes(codes, fmt), fmt=fmt, dtype=dtype)


def round_to_format(x, fmt: Format | str, **kwargs) -> jax.Array:
    """The value ``x`` takes when stored in ``fmt``: ``decode(encode(x, fmt, ...), fmt)``.

    Returns float32 (float64 for float64 input); accepts the keyword arguments of
    :func:`encode`.

    Example:
      1 + 2**-8 lies halfway between two bfloat16 values and rounds to the even one, 1.0.

      >>> import jax.numpy as jnp
      >>> from precisionlab import round_to_format
      >>> round_to_format(jnp.array([0.1, 1.00390625, 3.0]), "bf16").tolist()
      [0.10009765625, 1.0, 3.0]
      >>> round_to_format(jnp.float32(500.0), "e4m3", saturate=True).tolist()
      448.0
    """
    x = _check_input(x)
    out = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    return decode(encode(x, fmt, **kwargs), fmt, dtype=out)


def fields(codes, fmt: Format | str) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(sign, biased_exponent, mantissa)`` fields of float codes, each in the code dtype.

    Integer formats give ``(sign, 0, magnitude bits)`` of the two's-complement code.

    Example:
      -1.5 is -1.1 (binary) x 2**0: float8_e5m2 stores sign 1, exponent 0 + bias 15, mantissa 10.

      >>> import jax.numpy as jnp
      >>> from precisionlab import encode, fields
      >>> code = encode(jnp.float32(-1.5), "e5m2")
      >>> hex(int(code)), [int(f) for f in fields(code, "e5m2")]
      ('0xbe', [1, 15, 2])
    """
    fmt = get_format(fmt)
    return _fields(_check_codes(codes, fmt), fmt=fmt)


@partial(jax.jit, static_argnames="fmt")
def _fields(codes, *, fmt):
    codes = codes.astype(fmt.code_dtype)
    if isinstance(fmt, IntFormat):
        sign = (codes >> (fmt.bits - 1)) & 1 if fmt.signed else jnp.zeros_like(codes)
        low = codes & np.array((1 << (fmt.bits - int(fmt.signed))) - 1, fmt.code_dtype)
        return sign, jnp.zeros_like(codes), low
    m = fmt.mantissa_bits
    sign = (codes >> (fmt.bits - 1)) & 1 if fmt.signed else jnp.zeros_like(codes)
    exponent = (codes >> m) & np.array(fmt.exponent_field_max, fmt.code_dtype)
    mantissa = codes & np.array(fmt.mantissa_mask, fmt.code_dtype)
    return sign, exponent, mantissa


def classify(codes, fmt: Format | str) -> jax.Array:
    """Class of each code as int8 :class:`Class` values (ZERO, SUBNORMAL, NORMAL, INF, NAN).

    Integer codes are ZERO or NORMAL.

    Example:
      float8_e5m2's smallest normal is 2**-14, so 2**-16 is stored as a subnormal.

      >>> import jax.numpy as jnp
      >>> from precisionlab import Class, classify, encode
      >>> codes = encode(jnp.array([0.0, 2.0**-16, 1.0, jnp.inf, jnp.nan]), "e5m2")
      >>> [Class(c).name for c in classify(codes, "e5m2").tolist()]
      ['ZERO', 'SUBNORMAL', 'NORMAL', 'INF', 'NAN']
    """
    fmt = get_format(fmt)
    return _classify(_check_codes(codes, fmt), fmt=fmt)


@partial(jax.jit, static_argnames="fmt")
def _classify(codes, *, fmt):
    codes = codes.astype(fmt.code_dtype)
    if isinstance(fmt, IntFormat):
        mask = np.array((1 << fmt.bits) - 1, fmt.code_dtype)
        return jnp.where(codes & mask == 0, Class.ZERO, Class.NORMAL).astype(jnp.int8)
    work = _work_dtype(fmt)
    p = _parse(codes, fmt, work)
    exp_field = (codes >> fmt.mantissa_bits) & np.array(fmt.exponent_field_max, fmt.code_dtype)
    cls = jnp.full(codes.shape, Class.NORMAL, jnp.int8)
    if fmt.subnormals:
        cls = jnp.where(exp_field == 0, jnp.int8(Class.SUBNORMAL), cls)
        cls = jnp.where(p.m == 0, jnp.int8(Class.ZERO), cls)
    cls = jnp.where(p.inf, jnp.int8(Class.INF), cls)
    return jnp.where(p.nan, jnp.int8(Class.NAN), cls)
