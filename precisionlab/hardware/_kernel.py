"""The vectorized step: integer significands and exponents, int32 only (exact without x64).

Operands are decoded once into a signed significand (pre-shifted left so that no addend ever
needs a left shift) and an alignment exponent. A step over ``w`` products works on arrays laid
out ``(w, ..., M, N)``: elementwise int32 arithmetic, a max and a sum over the leading axis.

Bit budget (why int32 is enough): with ``L = max(0, F - pa - pb)`` the pre-shifted product
magnitude is below ``2**(F + 2)`` (``F`` fraction bits, ``pa``/``pb`` the inputs' fraction
bits), so groups of ``2**(28 - F)`` addends sum below ``2**30``; the group sums and the
aligned accumulator are then added in two 15-bit limbs, exact for any ``w`` used here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from precisionlab.formats import FloatFormat, get_format
from precisionlab.hardware._step import Step

__all__ = ["INPUT_FORMATS", "decode", "step_apply"]


def _fields(name: str) -> tuple[int, int, int, jnp.dtype]:
    f = get_format(name)
    assert isinstance(f, FloatFormat)  # the tensor cores' inputs are float formats
    return f.mantissa_bits, f.exponent_bits, 1 - f.emin, jnp.dtype(f.code_dtype)


#: format name -> (fraction bits, exponent bits, bias, code dtype) of the tensor cores' input
#: formats, from :mod:`precisionlab.formats`. The FP6 formats have no JAX dtype: their
#: operands are uint8 codes (low 6 bits), as Blackwell's f8f6f4 MMA reads them from 8-bit
#: containers.
_NAMES = ("float8_e4m3fn", "float8_e5m2", "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn",
          "float16", "bfloat16")  # fmt: skip
INPUT_FORMATS = {n: _fields(n) for n in _NAMES}
ZERO_E = -(1 << 12)  # alignment exponent of a zero: far below any real one
MAX_F = 28


def shift_for(step: Step, pa: int, pb: int) -> int:
    """Left pre-shift of the lhs significand so that every addend is a right shift (none for
    the wide kernel, which shifts both ways)."""
    if step.fraction_bits > MAX_F:
        return 0
    return max(0, step.fraction_bits - pa - pb)


def codes(x: jax.Array, fmt: str) -> jax.Array:
    """int32 codes of ``x`` in format ``fmt``: ``x`` holds that format's values (its dtype)
    or, for an integer ``x``, the codes themselves (bits above the format's width ignored)."""
    p, ebits, _, code_t = INPUT_FORMATS[fmt]
    if jnp.issubdtype(x.dtype, jnp.integer):
        return x.astype(jnp.int32) & ((1 << (1 + ebits + p)) - 1)
    if fmt == "float4_e2m1fn":  # a 4-bit dtype bitcasts to a 4-bit integer first
        return lax.bitcast_convert_type(x, jnp.uint4).astype(jnp.int32)
    return lax.bitcast_convert_type(x, code_t).astype(jnp.int32)


def decode(
    x: jax.Array, lshift: int, flush: bool, fmt: str | None = None
) -> tuple[jax.Array, jax.Array]:
    """Signed int32 significand (times ``2**lshift``) and int32 exponent of each element
    (``x == m * 2**(e - p)`` with ``p`` fraction bits); zeros get exponent ``ZERO_E``.
    ``fmt``: the element format (default: ``x``'s dtype; needed for integer codes)."""
    fmt = fmt or jnp.dtype(x.dtype).name
    p, ebits, bias, _ = INPUT_FORMATS[fmt]
    code = codes(x, fmt)
    width = 1 + ebits + p
    sign = (code >> (width - 1)) & 1
    ef = (code >> p) & ((1 << ebits) - 1)
    mf = code & ((1 << p) - 1)
    normal = ef != 0
    m = jnp.where(normal, mf | (1 << p), 0 if flush else mf)
    e = jnp.where(normal, ef - bias, 1 - bias)
    e = jnp.where(m == 0, ZERO_E, e)
    m = m << lshift
    return jnp.where(sign == 1, -m, m), e


def decode_f32(c: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Signed 24-bit significand and exponent of float32 ``c`` (``c = m * 2**(e - 23)``)."""
    bits = lax.bitcast_convert_type(c, jnp.int32)
    ef = (bits >> 23) & 0xFF
    mf = bits & 0x7FFFFF
    m = jnp.where(ef != 0, mf | (1 << 23), mf)
    e = jnp.where(ef != 0, ef - 127, -126)
    e = jnp.where(m == 0, ZERO_E, e)
    return jnp.where(bits < 0, -m, m), e


def _shr_tz(x: jax.Array, s: jax.Array) -> jax.Array:
    """``x / 2**s`` toward zero for int32 ``x`` (``|x| < 2**31``) and ``0 <= s``."""
    s = jnp.minimum(s, 31)
    mag = lax.shift_right_logical(jnp.abs(x), s)
    return jnp.where(x < 0, -mag, mag)


def bitlen(x: jax.Array) -> jax.Array:
    return 32 - lax.clz(x)


def to_f32(
    neg: jax.Array, hi: jax.Array, lo: jax.Array, q: jax.Array, bits: int, base: int = 15
) -> jax.Array:
    """float32 of ``+-(hi * 2**base + lo) * 2**q`` (``hi >= 0``, ``0 <= lo < 2**base``) cut
    toward zero to ``bits`` significant bits and to float32's subnormal grid."""
    lead = jnp.where(hi > 0, base + bitlen(hi), bitlen(lo))  # bit length of the magnitude
    drop = jnp.maximum(lead - bits, 0)
    drop = jnp.maximum(drop, -149 - q)  # below float32's smallest subnormal
    d_hi = jnp.clip(drop - base, 0, 31)
    d_lo = jnp.clip(drop, 0, 31)
    up = hi << jnp.clip(base - drop, 0, base)
    from_hi = jnp.where(drop >= base, lax.shift_right_logical(hi, d_hi), up)
    from_lo = jnp.where(drop >= base, 0, lax.shift_right_logical(lo, d_lo))
    mant = jnp.where(drop >= base + 32, 0, from_hi | from_lo)
    return pack_f32(neg, mant, q + drop)  # the value is mant * 2**e, e >= -149


def pack_f32(neg: jax.Array, mant: jax.Array, e: jax.Array) -> jax.Array:
    """float32 ``+-mant * 2**e`` for int32 ``0 <= mant <= 2**24`` already on float32's grid
    (``e >= -149`` or ``mant == 0``; ``2**24``: a rounding carry); inf beyond the range.
    Assembled from bits, not ``mant * 2**e``: XLA:CPU flushes subnormal products to zero."""
    carry = mant >> 24  # a carry to 2**24: one bit up, exact
    mant, e = mant >> carry, e + carry
    up = jnp.clip(24 - bitlen(mant), 0, 24)
    up = jnp.minimum(up, jnp.maximum(e + 149, 0))  # never below the subnormal grid
    mant, e = mant << up, e - up
    eb = e + 150
    bits = jnp.where(mant >= (1 << 23), (eb << 23) | (mant & 0x7FFFFF), mant)  # else subnormal
    bits = jnp.where((mant >= (1 << 23)) & (eb >= 255), 0x7F800000, bits)
    bits = jnp.where(mant == 0, 0, bits) | (neg.astype(jnp.int32) << 31)
    return lax.bitcast_convert_type(bits, jnp.float32)


def step_apply(
    am: jax.Array, ae: jax.Array, bm: jax.Array, be: jax.Array, c: jax.Array,
    step: Step, pa: int, pb: int,
) -> jax.Array:  # fmt: skip
    """One step for every output: ``am``/``ae`` (w, ..., M, 1), ``bm``/``be`` (w, ..., 1, N)
    decoded with :func:`decode`; ``c`` float32 (..., M, N). Returns float32 (..., M, N)."""
    f = step.fraction_bits
    if f > MAX_F:
        raise ValueError(f"Step.fraction_bits {f} exceeds the int32 kernel's {MAX_F} "
                         "(hardware._wide.step_apply computes it in two limbs)")  # fmt: skip
    w = am.shape[0]
    k0 = pa + pb + shift_for(step, pa, pb) - f  # >= 0
    es = ae + be
    emax = jnp.max(es, axis=0)
    if step.accumulator_in_alignment:
        cm, ce = decode_f32(c)
        big = jnp.maximum(emax, ce)
    else:
        big = emax
    t = _shr_tz(am * bm, big[None] - es + k0)
    # groups of at most 8 addends: exact in int32, and XLA:CPU vectorizes short reductions best
    g = max(1, min(w, 8, 1 << (MAX_F - f)))
    while w % g:
        g -= 1
    parts = jnp.sum(t.reshape((w // g, g, *t.shape[1:])), axis=1)
    if step.accumulator_in_alignment:
        sc = big - ce + 23 - f
        ca = jnp.where(sc >= 0, _shr_tz(cm, jnp.maximum(sc, 0)), cm << jnp.clip(-sc, 0, 7))
        parts = jnp.concatenate([parts, ca[None]], axis=0)
    # exact sum in two limbs: value = hi * 2**15 + lo
    hi = jnp.sum(parts >> 15, axis=0)
    lo = jnp.sum(parts & 0x7FFF, axis=0)
    hi = hi + (lo >> 15)
    lo = lo & 0x7FFF
    neg = hi < 0
    borrow = lo != 0
    mhi = jnp.where(neg, -hi - borrow.astype(jnp.int32), hi)
    mlo = jnp.where(neg & borrow, (1 << 15) - lo, lo)
    out = to_f32(neg, mhi, mlo, big - f, step.result_bits)
    if step.accumulator_in_alignment:
        return jnp.where(jnp.isfinite(c), out, c)  # an infinite accumulator stays so
    return c + out
