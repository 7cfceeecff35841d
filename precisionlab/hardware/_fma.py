"""``fma(2**k, p, c)`` in float32 with one rounding, as a GPU's FFMA computes it, on any backend.

DeepGEMM promotes each 128-k block's float32 partial ``p`` into its accumulator ``c`` with
``c += s * p`` (one FFMA) where ``s`` is the product of two power-of-two block scales (see
:mod:`precisionlab.recipes`' blockwise recipe on ``h100-deepgemm``). Computed exactly in
int32 (a float adder with guard and sticky bits), never with float arithmetic, because
XLA:CPU reads subnormals as zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from precisionlab.hardware._kernel import bitlen, pack_f32

__all__ = ["fma_pow2"]

_FAR = -(1 << 20)  # exponent of a zero addend: below any shift that matters


def _unpack(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sign (bool), significand normalised to [2**23, 2**24) (0 for zeros) and exponent of
    finite float32 ``x`` (``|x| = m * 2**e``); zeros get exponent ``_FAR``."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    ef = (bits >> 23) & 0xFF
    m = jnp.where(ef != 0, (bits & 0x7FFFFF) | (1 << 23), bits & 0x7FFFFF)
    e = jnp.where(ef != 0, ef - 150, -149)
    up = jnp.clip(24 - bitlen(m), 0, 24)  # subnormals: normalise (exact)
    m, e = m << up, e - up
    return bits < 0, m, jnp.where(m == 0, _FAR, e)


def _fma_finite(p: jax.Array, k: jax.Array, c: jax.Array) -> jax.Array:
    """``RN32(p * 2**k + c)`` for finite float32 ``p``, ``c`` and int32 ``k`` (``|k| < 2**19``).

    A float adder with guard bits and a sticky bit, in int32: the larger addend A (24-bit
    significand) is taken times 8; the smaller B is aligned to it, exact when the exponent
    gap d <= 3, else shifted right with the bits shifted out ORed into its last bit. With
    d >= 4 the sum keeps at least 26 bits, so rounding drops at least 2 bits, and ORing
    (jamming) the lost bits into bit 0 keeps the sum strictly inside the same interval
    between consecutive even integers as the exact sum: no midpoint of the rounding grid
    (multiples of 2 or coarser) separates them, so both round alike (the classic adder
    argument; checked against ``fractions.Fraction`` in the tests).
    """
    sx, mx, ex = _unpack(p)
    ex = jnp.where(mx == 0, _FAR, ex + k)
    sc, mc, ec = _unpack(c)
    x_big = ex >= ec
    sa, ma, ea = (jnp.where(x_big, u, v) for u, v in ((sx, sc), (mx, mc), (ex, ec)))
    sb, mb, eb = (jnp.where(x_big, v, u) for u, v in ((sx, sc), (mx, mc), (ex, ec)))
    d = ea - eb  # >= 0
    big_a = ma << 3  # < 2**27
    r = jnp.clip(d - 3, 0, 31)
    lost = (mb & ((jnp.int32(1) << jnp.minimum(r, 30)) - 1)) != 0
    lost = jnp.where(r >= 31, mb != 0, lost)
    shifted = jnp.where(r >= 31, 0, lax.shift_right_logical(mb, jnp.minimum(r, 31)))
    big_b = jnp.where(d <= 3, mb << jnp.clip(3 - d, 0, 3), shifted | lost.astype(jnp.int32))
    s = jnp.where(sa, -big_a, big_a) + jnp.where(sb, -big_b, big_b)  # |s| < 2**28
    neg, mag, q = s < 0, jnp.abs(s), ea - 3  # the sum is s * 2**q
    drop = jnp.maximum(bitlen(mag) - 24, -149 - q)
    dc = jnp.clip(drop, 1, 30)  # drop >= 31: mag < 2**28 < half a unit: rounds to zero
    kept = lax.shift_right_logical(mag, dc)
    rem = mag & ((jnp.int32(1) << dc) - 1)
    half = jnp.int32(1) << (dc - 1)
    up = (rem > half) | ((rem == half) & ((kept & 1) == 1))
    mant = jnp.where(drop > 0, kept + up.astype(jnp.int32), mag)
    e = jnp.where(drop > 0, q + drop, q)
    # a zero sum: +0, except -0 + -0 (round to nearest: x - x is +0)
    both_zero = (mx == 0) & (mc == 0)
    neg = jnp.where(s == 0, both_zero & sx & sc, neg)
    return pack_f32(neg, mant, e)


def fma_pow2(
    p: jax.Array, k: jax.Array, c: jax.Array, nan_scale: jax.Array | None = None
) -> jax.Array:
    """``fma(s, p, c)`` of float32 ``p`` and ``c`` with ``s = fl32(2**k)`` (int32 ``k``),
    one rounding to nearest even, as a GPU's FFMA (subnormals kept): exact for every input.
    ``nan_scale``: where True, ``s`` is NaN. Non-finite inputs and ``s`` = inf (``k >=
    128``) follow IEEE arithmetic; ``k <= -150`` gives ``s = 0``."""
    finite = (jnp.abs(p) < jnp.inf) & (jnp.abs(c) < jnp.inf)
    s_zero = k <= -150
    s_inf = k >= 128
    # s = +0: the product is a zero with p's sign (on the bits: no float op to simplify away)
    pb = lax.bitcast_convert_type(p, jnp.uint32)
    signed_zero = lax.bitcast_convert_type(pb & jnp.uint32(0x80000000), jnp.float32)
    p_in = jnp.where(finite, jnp.where(s_zero, signed_zero, p), 0)
    exact = _fma_finite(p_in, jnp.where(s_zero, 0, k), jnp.where(finite, c, 0))
    # the IEEE cases, s * p formed without multiplying (XLA:CPU reads subnormals as zero):
    # s = inf gives +-inf (NaN for a zero p), s = 0 a zero (NaN for an infinite p), any
    # other s leaves an infinite or NaN p as it is
    # (not ``bits & 0x7FFFFFFF == 0``: LLVM folds that into a float compare, which XLA:CPU
    # runs with subnormals read as zero)
    p_zero = _unpack(p)[1] == 0
    inf = jnp.where(pb >> 31 == 1, -jnp.inf, jnp.inf).astype(jnp.float32)
    prod = jnp.where(s_inf, jnp.where(p_zero, jnp.nan, inf), p)
    prod = jnp.where(s_zero, jnp.where(jnp.abs(p) < jnp.inf, signed_zero, jnp.nan), prod)
    special = ~finite | s_inf
    if nan_scale is not None:
        prod = jnp.where(nan_scale, jnp.float32(jnp.nan), prod)
        special = special | nan_scale
    return jnp.where(special, c + prod.astype(jnp.float32), exact)
