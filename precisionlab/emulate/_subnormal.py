"""bfloat16 arithmetic that keeps subnormals on a CPU that flushes them.

XLA on the CPU runs with denormals-are-zero and flush-to-zero: a float32 operation reads a
subnormal operand as 0 and writes a subnormal result as 0. bfloat16 has float32's exponent
range, so its subnormals (below 2**-126) are float32 subnormals, and a bfloat16 program's
``exp(x) / exp(x)`` for x near -90 is 0/0 = NaN on the CPU where an H100 (which keeps them)
returns 1. The arithmetic here never hands the float unit a subnormal:

- each operand's bfloat16 code is split into an integer significand (a float, 1 .. 255, exact)
  and a power-of-two exponent, with integer operations only;
- ``*``, ``/``, ``+`` and ``-`` run on the significands (normal floats): a product is exact, a
  quotient or a sum is rounded once to float32's 24 bits, which is then rounded once more to
  bfloat16's at most 8 (innocuous: 24 >= 2 * 8 + 2, the classic double-rounding bound, also
  for the fewer bits of a subnormal result);
- the result is rounded to nearest even on bfloat16's grid (subnormals included) and assembled
  from integer bits (:func:`pack`).

Only where an operand or the plain float32 result is zero or subnormal, or a division by zero
meets a subnormal numerator: elsewhere the plain float32 operation is exact already.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from precisionlab.intercept import _boundary as boundary

__all__ = ["arithmetic", "pack", "split"]

_SIGN16 = 0x8000


def _code(x: jax.Array) -> jax.Array:
    """int32 bfloat16 code of ``x`` (bfloat16 values in any float dtype)."""
    return lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16).astype(jnp.int32)


def split(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(m, e)`` with ``x == m * 2**e``: ``m`` a float32 integer, signed, ``|m|`` in 1..255 (0
    for a zero), ``e`` int32; from the bfloat16 code alone (no float arithmetic reads x)."""
    code = _code(x)
    field, frac = (code >> 7) & 0xFF, code & 0x7F
    mant = jnp.where(field != 0, frac | 0x80, frac)
    exp = jnp.where(field != 0, field - 127, -126) - 7
    m = mant.astype(jnp.float32)  # an integer below 2**8: exact, and normal unless 0
    return jnp.where(code & _SIGN16 != 0, -m, m), exp


def _pow2(k: jax.Array) -> jax.Array:
    """float32 ``2**k`` for int32 ``-126 <= k <= 127`` (assembled: no arithmetic)."""
    return lax.bitcast_convert_type((k + 127) << 23, jnp.float32)


def pack(m: jax.Array, e: jax.Array) -> jax.Array:
    """bfloat16 ``m * 2**e`` rounded to nearest even, subnormals and overflow to inf included,
    for float32 ``m`` normal or zero (any sign) and int32 ``e``; assembled from integer bits."""
    bits = lax.bitcast_convert_type(m, jnp.int32)
    sign = (bits >> 16) & _SIGN16
    field = (bits >> 23) & 0xFF
    mant = (bits & 0x7FFFFF) | 0x800000  # value = mant * 2**(E - 23), E below
    big_e = field - 127 + e
    keep = jnp.minimum(7, big_e + 133)  # fraction bits kept: 7, fewer for a subnormal
    shift = jnp.clip(23 - keep, 0, 31)
    q = lax.shift_right_logical(mant, shift)
    rem = mant - (q << shift)
    half = jnp.int32(1) << jnp.maximum(shift - 1, 0)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).astype(jnp.int32)
    carry = q >> 8  # q == 256: one binade up
    q, big_e = jnp.where(carry == 1, 128, q), big_e + carry
    normal = sign | ((big_e + 127) << 7) | (q & 0x7F)
    out = jnp.where(big_e >= -126, normal, sign | q)  # a subnormal's q is its code, 128: 2**-126
    out = jnp.where(big_e + 127 >= 255, sign | 0x7F80, out)
    out = jnp.where(field == 0, sign, out)  # m == 0
    return lax.bitcast_convert_type(out.astype(jnp.uint16), jnp.bfloat16)


def _tiny(code: jax.Array) -> jax.Array:
    """Zero or subnormal (exponent field 0), from the code."""
    return (code & 0x7F80) == 0


def arithmetic(name: str, a: jax.Array, b: jax.Array, plain: jax.Array) -> jax.Array:
    """``a name b`` (``name`` one of :data:`precisionlab.intercept._boundary.ARITHMETIC`) for
    bfloat16 values ``a``, ``b`` (any float dtype), rounded to bfloat16 as IEEE arithmetic with
    subnormals does; ``plain`` is the same operation as this machine computed it, already
    rounded to bfloat16, kept wherever it is exact (no zero or subnormal operand or result).
    Returns bfloat16."""
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    a, b = jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape)
    ca, cb, cp = _code(a), _code(b), _code(plain)
    finite = ((ca & 0x7F80) != 0x7F80) & ((cb & 0x7F80) != 0x7F80)
    (ma, ea), (mb, eb) = split(a), split(b)
    if name == boundary.MUL:
        m, e = ma * mb, ea + eb
    elif name == boundary.DIV:
        safe = jnp.where(mb == 0, jnp.float32(1), mb)
        m, e = ma / safe, ea - eb
    else:
        if name == boundary.SUB:
            mb = -mb
        hi = (ea >= eb) | (mb == 0)
        hi = hi & (ma != 0)
        e_hi, e_lo = jnp.where(hi, ea, eb), jnp.where(hi, eb, ea)
        m_hi, m_lo = jnp.where(hi, ma, mb), jnp.where(hi, mb, ma)
        d = e_hi - e_lo
        # beyond 40 binades the smaller one is far below half an ulp of the result's 24 bits
        m = m_hi + jnp.where(d > 40, 0.0, m_lo * _pow2(-jnp.minimum(d, 40)))
        e = e_hi
    exact = pack(m, e)
    if name == boundary.DIV:  # x / 0 with a subnormal x: the CPU read 0 / 0
        zero_b = (cb & 0x7FFF) == 0
        signed_inf = ((ca ^ cb) & _SIGN16) | 0x7F80
        inf = lax.bitcast_convert_type(signed_inf.astype(jnp.uint16), jnp.bfloat16)
        exact = jnp.where(zero_b, jnp.where((ca & 0x7FFF) == 0, plain, inf), exact)
    use = finite & (_tiny(ca) | _tiny(cb) | _tiny(cp))
    return jnp.where(use, exact, plain.astype(jnp.bfloat16))
