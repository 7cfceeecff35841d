"""Exact power-of-two arithmetic on float32 bit patterns.

Power-of-two scales (E8M0, the MX formats) must be applied exactly, including to and from
float32 subnormals. XLA on CPU flushes float32 subnormals in float arithmetic, so
``x * 2.0**k`` is not exact there; these helpers work on the integer bit patterns instead.
"""

from __future__ import annotations

import math
import struct

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "SCALE_EXPONENT_MAX",
    "SCALE_EXPONENT_MIN",
    "ceil_log2",
    "ceil_log2_ratio",
    "floor_log2",
    "ldexp",
    "pow2",
    "round_to_exponent",
    "scale_exponent",
]

_SIGN = 0x80000000
_MANT = 0x007FFFFF
_HIDDEN = 0x00800000
#: floor_log2 of zero: below every float32 exponent, so clamping sends it to the minimum.
ZERO_LOG2 = -1000
#: The exponent range of every power-of-two scale: E8M0's, 2^-127 .. 2^127.
SCALE_EXPONENT_MIN, SCALE_EXPONENT_MAX = -127, 127


def _bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32)


def _split(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sign bit, int32 floor(log2|x|) and the 23 fraction bits of |x| normalized (so that
    |x| = (1 + frac / 2**23) * 2**floor_log2), for finite nonzero x, subnormals included."""
    b = _bits(x)
    sign = b & jnp.uint32(_SIGN)
    exp_field = ((b >> 23) & jnp.uint32(0xFF)).astype(jnp.int32)
    mant = b & jnp.uint32(_MANT)
    lead = lax.clz(mant).astype(jnp.int32)  # 9..32 for a 23-bit field
    sub_shift = lead - 8  # moves a subnormal's leading one to bit 23
    sub_frac = lax.shift_left(mant, jnp.clip(sub_shift, 0, 31).astype(jnp.uint32))
    is_sub = exp_field == 0
    frac = jnp.where(is_sub, sub_frac & jnp.uint32(_MANT), mant)
    flog2 = jnp.where(is_sub, -126 - sub_shift, exp_field - 127)
    flog2 = jnp.where(is_sub & (mant == 0), jnp.int32(ZERO_LOG2), flog2)
    return sign, flog2, frac


def floor_log2(x: jax.Array) -> jax.Array:
    """int32 ``floor(log2(|x|))`` of float32 ``x``, exact for subnormals too.

    Zero gives ``ZERO_LOG2`` (-1000); inf and NaN give 128.
    """
    return _split(x)[1]


def ceil_log2(x: jax.Array) -> jax.Array:
    """int32 ``ceil(log2(|x|))``, exact (zero gives ``ZERO_LOG2``)."""
    _, flog2, frac = _split(x)
    return flog2 + ((frac != 0) & (flog2 != ZERO_LOG2)).astype(jnp.int32)


def _f32_parts(c: float) -> tuple[int, int]:
    """floor(log2(c)) and normalized fraction bits of a positive float32-exact constant."""
    if not (c > 0 and math.isfinite(c)) or float(struct.unpack("<f", struct.pack("<f", c))[0]) != c:
        raise ValueError(f"the constant must be a positive float32 value, got {c!r}")
    mant, exp = math.frexp(c)  # c = mant * 2**exp, mant in [0.5, 1)
    return exp - 1, round((mant * 2 - 1) * 2**23)


def round_to_exponent(x: jax.Array, mbits: int) -> jax.Array:
    """float32 ``|x|`` with half a unit of its ``mbits``-th fraction bit added and every
    fraction bit then cleared (torchao's EVEN rule: only the exponent survives, rounded up
    where ``|x|`` rounds up to the next power of two at ``mbits`` bits). Integer arithmetic
    on the bits, so subnormals are exact; inf stays inf and NaN stays NaN.
    """
    if not 0 <= mbits < 23:
        raise ValueError(f"mbits must be in 0..22, got {mbits}")
    b = _bits(x) & jnp.uint32(0x7FFFFFFF)
    r = (b + jnp.uint32(1 << (22 - mbits))) & jnp.uint32(0x7F800000)
    r = jnp.where(b >= jnp.uint32(0x7F800000), b, r)  # inf and NaN unchanged
    return lax.bitcast_convert_type(r, jnp.float32)


def ceil_log2_ratio(a: jax.Array, c: float) -> jax.Array:
    """int32 ``ceil(log2(|a| / c))`` computed exactly (no rounded division).

    ``c`` is a positive constant exactly representable in float32 (a format's max).
    With ``|a| = (1+fa) 2**ea`` and ``c = (1+fc) 2**ec``, the log lies in
    ``(ea - ec - 1, ea - ec + 1)`` and the ceiling is ``ea - ec + (fa > fc)``.
    """
    ec, fc = _f32_parts(float(c))
    _, ea, fa = _split(a)
    out = ea - ec + (fa > jnp.uint32(fc)).astype(jnp.int32)
    return jnp.where(ea == ZERO_LOG2, jnp.int32(ZERO_LOG2), out)


def ldexp(x: jax.Array, k: jax.Array) -> jax.Array:
    """float32 ``x * 2**k`` rounded once (to nearest even), subnormal inputs and results too.

    ``k`` is an int32 array broadcastable to ``x``. Overflow gives inf; zeros, inf and NaN
    pass through unchanged.
    """
    x = jnp.asarray(x, jnp.float32)
    k = jnp.asarray(k, jnp.int32)
    b = _bits(x)
    sign = b & jnp.uint32(_SIGN)
    exp_field = ((b >> 23) & jnp.uint32(0xFF)).astype(jnp.int32)
    mant = b & jnp.uint32(_MANT)
    special = (exp_field == 255) | ((exp_field == 0) & (mant == 0))
    lead = lax.clz(mant).astype(jnp.int32)
    sub_shift = jnp.clip(lead - 8, 0, 31)
    is_sub = exp_field == 0
    sig = jnp.where(is_sub, lax.shift_left(mant, sub_shift.astype(jnp.uint32)), mant | _HIDDEN)
    e = jnp.where(is_sub, 1 - sub_shift, exp_field) + k  # biased exponent of the leading bit
    normal_bits = sign | (e.astype(jnp.uint32) << 23) | (sig & jnp.uint32(_MANT))
    # Subnormal result: shift the 24-bit significand right by r = 1 - e, round to nearest even.
    r = jnp.clip(1 - e, 1, 31).astype(jnp.uint32)
    q = lax.shift_right_logical(sig, r)
    rem = sig - lax.shift_left(q, r)
    half = lax.shift_left(jnp.uint32(1), r - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    sub_mag = jnp.where(1 - e > 25, jnp.uint32(0), q + up.astype(jnp.uint32))
    out = jnp.where(e >= 1, normal_bits, sign | sub_mag)
    out = jnp.where(e >= 255, sign | jnp.uint32(0x7F800000), out)
    out = jnp.where(special, b, out)
    return lax.bitcast_convert_type(out, jnp.float32)


def pow2(k: jax.Array) -> jax.Array:
    """float32 ``2**k`` for int32 ``k`` (subnormal for k < -126, 0 below -149, inf above 127)."""
    k = jnp.asarray(k, jnp.int32)
    return ldexp(jnp.ones(k.shape, jnp.float32), k)


def scale_exponent(
    c: jax.Array, target: float, emax_target: int, rule: str, mbits: int = 0
) -> jax.Array:
    """Exponent of the power-of-two scale mapping clip value ``c`` near ``target``.

    floor: floor(log2 c) - emax_target (OCP MX rule; elements above target saturate).
    ceil:  ceil(log2 c) - emax_target (torchao CEIL).
    rceil: ceil(log2(c / target)) (TE / cuBLAS; never saturates).
    even:  floor rule on c rounded to ``mbits`` mantissa bits (torchao EVEN).
    All exact on the bits (XLA on CPU flushes float32 subnormals in float arithmetic).
    """
    if rule == "floor":
        e = floor_log2(c) - emax_target
    elif rule == "ceil":
        e = ceil_log2(c) - emax_target
    elif rule == "even":
        e = floor_log2(round_to_exponent(c, mbits)) - emax_target
    else:
        e = ceil_log2_ratio(c, target)
    zero = floor_log2(c) == ZERO_LOG2
    e = jnp.where(zero, SCALE_EXPONENT_MIN, e)
    return jnp.clip(e, SCALE_EXPONENT_MIN, SCALE_EXPONENT_MAX).astype(jnp.int32)
