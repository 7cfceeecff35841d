"""The blockwise recipe on Hopper as DeepGEMM runs it: per-128 FP8 chains, float32 promotion.

DeepSeek-V3 (technical report, section 3.3.2, "Increasing accumulation precision") runs its
1 x 128 / 128 x 128 block-scaled FP8 GEMMs with DeepGEMM. Its Hopper kernels
(``deep_gemm/include/deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh``: 1 x 128 lhs scales, 128 x 128
rhs scales, used for fprop and dgrad; ``sm90_fp8_gemm_1d1d.cuh``: 1 x 128 scales on both
sides, used for wgrad; github.com/deepseek-ai/DeepGEMM at commit
54e22612409371d6364144b69086735beb54e98b) do, for each output and each 128-wide K block j:

1. ``p_j``: 4 ``wgmma`` k32 FP8 steps, the first with ``scale_d = 0`` (the chain starts from
   zero): :func:`precisionlab.hardware.gemm` on the block with the Hopper FP8 step (checked
   bit for bit on an H100) and K = 128, one chain;
2. ``s_j = fl32(sa_j * sb_j)``: the two scales multiplied first (``scale_0_0 = scale_a_0 *
   scale_b_0`` in 1d2d; ``scale_a_0 * scale_b_0 * accum[i]`` in 1d1d, C++'s left-to-right);
3. ``acc = fma(s_j, p_j, acc)``: ``final_accum[i] += s * accum[i]``, which nvcc contracts to
   one FFMA (``--fmad=true`` is its default and DeepGEMM's JIT flags do not change it; no
   ``--use_fast_math``, no ``-ftz``): one rounding to nearest even, subnormals kept.

``acc`` starts at +0 and takes the blocks in K order. The result is the float32 ``acc``
(1d1d stores it; 1d2d stores it rounded to nearest bfloat16, which is the recipe's final
cast when its result dtype is bfloat16).

The recipe's scales are powers of two (``block_exp``), so ``s_j = 2**k`` with ``k`` the sum
of the two exponents (``fl32`` of it: 0 for ``k <= -150``, inf for ``k >= 128``, else exact,
subnormal included), and the FFMA is ``RN(acc + p * 2**k)``, computed here exactly in int32
(:func:`fma_pow2`). The scale promotion is taken from DeepGEMM's source; it is not checked on
hardware.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["BLOCK", "blockwise_gemm", "fma_pow2"]

#: DeepGEMM's scaling block along K (``BLOCK_K == 128``, asserted in its kernels).
BLOCK = 128
_FAR = -(1 << 20)  # exponent of a zero addend: below any shift that matters


def _bitlen(x: jax.Array) -> jax.Array:
    return 32 - lax.clz(x)


def _unpack(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sign (bool), significand normalised to [2**23, 2**24) (0 for zeros) and exponent of
    finite float32 ``x`` (``|x| = m * 2**e``); zeros get exponent ``_FAR``."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    ef = (bits >> 23) & 0xFF
    m = jnp.where(ef != 0, (bits & 0x7FFFFF) | (1 << 23), bits & 0x7FFFFF)
    e = jnp.where(ef != 0, ef - 150, -149)
    up = jnp.clip(24 - _bitlen(m), 0, 24)  # subnormals: normalise (exact)
    m, e = m << up, e - up
    return bits < 0, m, jnp.where(m == 0, _FAR, e)


def _pack(neg: jax.Array, mant: jax.Array, e: jax.Array) -> jax.Array:
    """float32 ``+-mant * 2**e`` for ``0 <= mant <= 2**24`` already rounded to float32's grid
    (``e >= -149`` or ``mant == 0``); inf beyond the range."""
    carry = mant >> 24  # a rounding carry to 2**24: one bit up, exact
    mant, e = mant >> carry, e + carry
    up = jnp.clip(24 - _bitlen(mant), 0, 24)
    up = jnp.minimum(up, jnp.maximum(e + 149, 0))  # never below the subnormal grid
    mant, e = mant << up, e - up
    eb = e + 150
    normal = (eb << 23) | (mant & 0x7FFFFF)
    bits = jnp.where(mant >= (1 << 23), normal, mant)  # else subnormal: e == -149
    bits = jnp.where((mant >= (1 << 23)) & (eb >= 255), 0x7F800000, bits)
    bits = jnp.where(mant == 0, 0, bits) | (neg.astype(jnp.int32) << 31)
    return lax.bitcast_convert_type(bits, jnp.float32)


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
    drop = jnp.maximum(_bitlen(mag) - 24, -149 - q)
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
    return _pack(neg, mant, e)


def fma_pow2(p: jax.Array, k: jax.Array, c: jax.Array, nan_scale: jax.Array | None = None):
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


def _blocks(x: jax.Array) -> jax.Array:
    """(B, R, K) -> (B, K / 128, R, 128)."""
    b, r, k = x.shape
    return jnp.transpose(x.reshape(b, r, k // BLOCK, BLOCK), (0, 2, 1, 3))


def blockwise_gemm(qa, qb, preset: str) -> jax.Array:
    """float32 (B, M, N) of blockwise-quantized ``qa`` (B, M, K) and ``qb`` (B, N, K)
    (elements E4M3 values, power-of-two block scales with ``block_exp``; K a multiple of
    128) as DeepGEMM's Hopper kernels compute it under ``preset`` (see the module
    docstring)."""
    from precisionlab import hardware as hw

    kw = hw.preset(preset)
    a8 = _blocks(qa.elems.astype(jnp.float8_e4m3fn))  # exact: the elements are E4M3 values
    b8 = _blocks(qb.elems.astype(jnp.float8_e4m3fn))

    def block(a, b):  # (M, 128) x (N, 128): one 128-k chain on the Hopper FP8 step
        return hw.gemm(a, b.T, **kw)

    parts = jax.vmap(jax.vmap(block))(a8, b8)  # (B, K / 128, M, N)

    def per_block(q):  # the scale exponent (int32) and NaN flag of each (row, block)
        exp = jnp.broadcast_to(q.block_exp, q.elems.shape)[..., ::BLOCK]
        nan = jnp.isnan(jnp.broadcast_to(q.block_inv, q.elems.shape)[..., ::BLOCK])
        return jnp.moveaxis(exp, -1, 1), jnp.moveaxis(nan, -1, 1)  # (B, K / 128, R)

    ea, na = per_block(qa)
    eb, nb = per_block(qb)
    k = ea[..., :, None] + eb[..., None, :]  # log2 fl32(sa * sb), before its range
    nan = na[..., :, None] | nb[..., None, :]

    def promote(acc, x):
        p, kj, nj = x
        return fma_pow2(p, kj, acc, nj), None

    zero = jnp.zeros(parts.shape[:1] + parts.shape[2:], jnp.float32)
    xs = tuple(jnp.moveaxis(t, 1, 0) for t in (parts, k, nan))
    acc, _ = lax.scan(promote, zero, xs)
    return acc
