"""The general rounding and packing core: (-1)**neg * m * 2**e2 rounded into any format.

:func:`pack` rounds a :class:`~precisionlab.bits._parse.Parsed` value into an integer or a
float format in any rounding mode and returns its codes; :func:`finish` (overflow, flushing,
the input's specials) is shared with the float32 fast paths of
:mod:`precisionlab.bits._fast_encode`, so the conventions are the same by construction.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from precisionlab.bits._parse import Parsed, const, shl, shr
from precisionlab.bits._rounding import Rounding
from precisionlab.formats import FloatFormat, Format, IntFormat, Specials


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
    half = shl(one, jnp.minimum(shift - 1, width - 1))  # 0 when shift <= 0, then r == 0
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
    frac = jnp.where(shift <= width, shl(r, width - shift), shr(r, shift - width))
    frac32 = (frac >> (width - 32)).astype(jnp.uint32) if width > 32 else frac
    drop = 32 - random_bits
    assert rand is not None  # stochastic rounding draws its bits
    return (rand >> drop) < (frac32 >> drop)


def _pack_int(
    p: Parsed, fmt: IntFormat, mode: Rounding, rand: jax.Array | None, random_bits: int
) -> jax.Array:
    assert p.e2 is not None
    work = p.m.dtype
    width = jnp.iinfo(work).bits
    nonzero = p.m != 0
    top = (width - 1) - lax.clz(p.m).astype(jnp.int32)
    # Anything at or above 2**bits saturates; clamp so the shifts below stay in range.
    too_big = nonzero & (p.e2 + top >= fmt.bits)
    shift = jnp.maximum(-p.e2, 0)
    shift_c = jnp.minimum(shift, width - 1)
    q = shr(p.m, shift_c)
    r = p.m & (shl(jnp.ones_like(p.m), shift_c) - 1)
    r = jnp.where(shift > shift_c, p.m, r)  # the whole significand is below the quantum
    q = jnp.where(p.e2 > 0, shl(p.m, p.e2), q)
    up = _round_up(q, r, shift, p.neg, mode, rand, random_bits)
    q = q + up.astype(work)
    if mode is Rounding.TO_ODD:
        q = q | (r != 0).astype(work)
    max_pos = const(fmt.max, work)
    max_neg = const(-fmt.min, work)
    q = jnp.where(too_big | p.inf, jnp.where(p.neg, max_neg, max_pos), q)
    q = jnp.where(p.neg, jnp.minimum(q, max_neg), jnp.minimum(q, max_pos))
    q = jnp.where(p.nan, jnp.zeros_like(q), q)
    mask = const((1 << fmt.bits) - 1, work)
    code = jnp.where(p.neg, (~q + const(1, work)) & mask, q)
    return code.astype(fmt.code_dtype)


def pack(
    p: Parsed,
    fmt: Format,
    mode: Rounding,
    saturate: bool,
    subnormals: bool,
    rand: jax.Array | None,
    random_bits: int,
) -> jax.Array:
    """Round (-1)**neg * m * 2**e2 into ``fmt`` by ``mode`` and return its codes.

    ``rand``: uint32 random bits for stochastic rounding, of which the top ``random_bits``
    are used; else None. ``saturate`` and ``subnormals`` as in
    :func:`~precisionlab.bits.encode` (float formats only).
    """
    if isinstance(fmt, IntFormat):
        return _pack_int(p, fmt, mode, rand, random_bits)
    work = p.m.dtype
    width = jnp.iinfo(work).bits
    m_bits = fmt.mantissa_bits
    one = jnp.ones_like(p.m)
    nonzero = p.m != 0

    # Exponent of the leading bit; clamped to the format's range (beyond it is overflow).
    assert p.e2 is not None
    lead: int | jax.Array
    if p.lead is not None and p.emin is not None and fmt.emin > p.emin:
        lead = p.lead  # a source subnormal is below fmt's range whatever its exponent
    else:
        lead = (width - 1) - lax.clz(p.m).astype(jnp.int32)
    exp = p.e2 + lead
    beyond = nonzero & (exp > fmt.emax + 1)
    exp_c = jnp.clip(exp, fmt.emin, fmt.emax + 1)
    shift = exp_c - m_bits - p.e2  # bits of m below the target's last significand bit
    # Beyond m's width + 2 every remainder is below half: clamping keeps the shifts in range.
    cap = jnp.minimum(shift, width - 2)
    q = jnp.where(shift > 0, shr(p.m, cap), shl(p.m, -shift))
    r = jnp.where(shift > 0, p.m & (shl(one, cap) - 1), jnp.zeros_like(p.m))
    r = jnp.where(shift > cap, p.m, r)
    up = _round_up(q, r, shift, p.neg, mode, rand, random_bits)
    q = q + up.astype(work)
    if mode is Rounding.TO_ODD:
        q = q | (r != 0).astype(work)

    # Code of the magnitude; a carry out of the significand moves to the next binade.
    base = (exp_c - fmt.emin + (1 if fmt.subnormals else 0)).astype(work)
    mag = (base << const(m_bits, work)) + q - const(1 << m_bits, work)
    mag = jnp.where(nonzero, mag, jnp.zeros_like(mag))
    below = nonzero & (exp < fmt.emin) if not fmt.subnormals else None
    overflow = beyond | (mag > const(fmt.max_code_magnitude, work))
    return finish(mag, overflow, below, nonzero, p, fmt, mode, saturate, subnormals)


def finish(
    mag: jax.Array,
    overflow: jax.Array,
    below: jax.Array | None,
    nonzero: jax.Array,
    p: Parsed,
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
    max_mag = const(fmt.max_code_magnitude, work)
    if below is not None:
        overflow = overflow & ~below
    inf_mag = const(fmt.exponent_field_max << m_bits, work)
    nan_mag = const(nan_magnitude(fmt), work)
    false = jnp.zeros(mag.shape, bool)

    # Overflow: +-max when saturating, for formats without specials, and for modes that
    # round toward zero for this sign; otherwise inf, or NaN where there is no inf.
    to_nan = false
    if saturate or fmt.specials is Specials.NONE:
        mag = jnp.where(overflow, max_mag, mag)
    else:
        to_special = overflow & ~toward_zero(mode, p.neg)
        mag = jnp.where(overflow, max_mag, mag)
        if fmt.has_inf:
            mag = jnp.where(to_special, inf_mag, mag)
        else:
            to_nan = to_special

    if fmt.subnormals and not subnormals:
        mag = jnp.where(mag < const(1 << m_bits, work), jnp.zeros_like(mag), mag)
    if not fmt.subnormals:  # no zero: values below the smallest become the smallest
        assert below is not None
        mag = jnp.where(below, jnp.zeros_like(mag), mag)

    # Specials of the input.
    if saturate or fmt.specials is Specials.NONE:
        mag = jnp.where(p.inf, max_mag, mag)
    elif fmt.has_inf:
        mag = jnp.where(p.inf, inf_mag, mag)
    else:
        to_nan = to_nan | p.inf
    sign = jnp.where(p.neg, const(fmt.sign_mask, work), jnp.zeros_like(mag))
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
        code = jnp.where(to_nan, const(fmt.sign_mask, work), code)
    if not fmt.signed:
        invalid = p.neg & ~p.nan & (nonzero | p.inf | (not fmt.has_zero))
        low = jnp.zeros_like(code)
        code = jnp.where(invalid, low if saturate or not fmt.has_nan else nan_mag, code)
    if not fmt.has_zero:
        zero_in = ~nonzero & ~p.nan & ~p.inf
        code = jnp.where(zero_in, jnp.zeros_like(code) if saturate else nan_mag, code)
    return code.astype(fmt.code_dtype)


def nan_magnitude(fmt: FloatFormat) -> int:
    if fmt.specials is Specials.IEEE:
        return (fmt.exponent_field_max << fmt.mantissa_bits) | (1 << (fmt.mantissa_bits - 1))
    if fmt.specials is Specials.FN:
        return (fmt.exponent_field_max << fmt.mantissa_bits) | fmt.mantissa_mask
    return 0  # fnuz NaN is the sign-only code, set separately; none has no NaN


def _align_payload(p: Parsed, fmt: FloatFormat) -> jax.Array:
    """Keep the top bits of a NaN's payload (as IEEE conversions do)."""
    diff = p.payload_bits - fmt.mantissa_bits
    if diff >= 0:
        dtype = p.payload.dtype
        return (p.payload >> const(diff, dtype)) & const(fmt.mantissa_mask, dtype)
    return p.payload << const(-diff, p.payload.dtype)


def toward_zero(mode: Rounding, neg: jax.Array) -> jax.Array | bool:
    if mode in (Rounding.TOWARD_ZERO, Rounding.TO_ODD):
        return jnp.ones(neg.shape, bool)
    if mode is Rounding.UP:
        return neg
    if mode is Rounding.DOWN:
        return ~neg
    return jnp.zeros(neg.shape, bool)
