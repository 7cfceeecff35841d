"""Block-scaled GEMMs: Blackwell's FP4 step (``kind::mxf4nvf4``) and MXFP8's exponent offsets.

FP4 (E2M1) values times 2 are integers of at most 4 bits, so a group's exact sum of
``exact_group`` products is an int32 matmul (exact on every backend); the group addends,
scaled by the block scales' significands, then go through the two-limb aligned sum of
:mod:`precisionlab.hardware._wide` together with the accumulator.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from precisionlab.hardware import _kernel as _k
from precisionlab.hardware import _wide
from precisionlab.hardware._step import Step

__all__ = ["SCALE_FORMATS", "chain_fp4", "decode_scales", "exponent_offsets"]

#: block-scale dtype -> (fraction bits of its significand, what it is)
SCALE_FORMATS = {
    "float8_e8m0fnu": (0, "E8M0 (MXFP4, MXFP8): powers of two 2**-127 .. 2**127, 0xFF NaN"),
    "float8_e4m3fn": (3, "UE4M3 (NVFP4): E4M3 without its sign bit, 0x7F NaN"),
}


def decode_scales(s: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """int32 significand ``m``, int32 exponent ``e`` (value ``m * 2**(e - p)``, ``p`` from
    :data:`SCALE_FORMATS`; E8M0's exponent runs down to -127, UE4M3's subnormals count with
    exponent -6) and a NaN mask. UE4M3's sign bit is ignored, as the hardware does."""
    name = jnp.dtype(s.dtype).name
    code = lax.bitcast_convert_type(s, jnp.uint8).astype(jnp.int32)
    if name == "float8_e8m0fnu":
        return jnp.ones_like(code), code - 127, code == 0xFF
    code = code & 0x7F
    ef, mf = code >> 3, code & 7
    m = jnp.where(ef != 0, mf | 8, mf)
    e = jnp.where(ef != 0, ef - 7, -6)
    e = jnp.where(m == 0, _k.ZERO_E, e)  # a zero scale takes its group out of the alignment
    return m, e, code == 0x7F


def exponent_offsets(s: jax.Array, block: int, axis: int) -> tuple[jax.Array, jax.Array]:
    """E8M0 block scales as per-element exponent offsets along ``axis`` (repeated ``block``
    times) and the NaN mask of the scales (for MXFP8 on the f8f6f4 step)."""
    _, e, nan = decode_scales(s)
    return jnp.repeat(e, block, axis=axis), nan


def _fp4_ints(x: jax.Array) -> jax.Array:
    """E2M1 values times 2, as int32 (exact: -12 .. 12)."""
    return (x.astype(jnp.float32) * 2).astype(jnp.int32)


def chain_fp4(a: jax.Array, b: jax.Array, sa: jax.Array, sb: jax.Array, step: Step) -> jax.Array:
    """float32 accumulators of block-scaled ``a`` (M, K) x ``b`` (K, N), E2M1, with block
    scales ``sa`` (M, K / block) and ``sb`` (K / block, N), one chain of ``step`` over K."""
    m, kk = a.shape
    n = b.shape[1]
    g = step.exact_group
    block = kk // sa.shape[1]
    nsteps = kk // step.products
    gps = step.products // g
    pf = SCALE_FORMATS[jnp.dtype(sa.dtype).name][0]
    p = 2 + 2 * pf  # fraction bits of a group's integer addend
    ma, ea, nan_a = decode_scales(sa)
    mb, eb, nan_b = decode_scales(sb)
    rep = block // g
    ma, ea = jnp.repeat(ma, rep, axis=1), jnp.repeat(ea, rep, axis=1)  # (M, groups)
    mb, eb = jnp.repeat(mb, rep, axis=0), jnp.repeat(eb, rep, axis=0)  # (groups, N)
    # |group sum| <= g * 144 < 2**(8 + log2 g), UE4M3 significands < 2**4, E8M0's are 1;
    # cut to the grid, an addend is below 2**(bits + F - p)
    bits = 8 + (g - 1).bit_length() + (8 if pf else 0)
    _wide.check_budget(bits + step.fraction_bits - p, gps + 1, "block-scaled FP4 step")
    ai = _fp4_ints(a).reshape(m, nsteps, gps, g).transpose(1, 2, 0, 3)  # (s, gps, M, g)
    bi = _fp4_ints(b).reshape(nsteps, gps, g, n)  # (s, gps, g, N)
    ma = ma.reshape(m, nsteps, gps).transpose(1, 2, 0)[..., None]  # (s, gps, M, 1)
    ea = ea.reshape(m, nsteps, gps).transpose(1, 2, 0)[..., None]
    mb = mb.reshape(nsteps, gps, 1, n)
    eb = eb.reshape(nsteps, gps, 1, n)

    def one_step(c: jax.Array, x: tuple[jax.Array, ...]) -> tuple[jax.Array, None]:
        xa, xb, xma, xea, xmb, xeb = x
        ssum = jnp.einsum("gmk,gkn->gmn", xa, xb, preferred_element_type=jnp.int32)
        addend = ssum * xma * xmb
        ex = jnp.broadcast_to(xea + xeb, addend.shape)
        if step.accumulator_in_alignment:
            cm, ce = _k.decode_f32(c)
            out = _wide.aligned_sum([addend, cm[None]], [ex, ce[None]], [p, 23],
                                    step.fraction_bits, step.result_bits)  # fmt: skip
        else:
            out = c + _wide.aligned_sum([addend], [ex], [p], step.fraction_bits, step.result_bits)
        return jnp.where(jnp.isfinite(c), out, c), None  # inf stays inf

    acc, _ = lax.scan(one_step, jnp.zeros((m, n), jnp.float32), (ai, bi, ma, ea, mb, eb))
    nan = jnp.any(nan_a, axis=1)[:, None] | jnp.any(nan_b, axis=0)[None, :]
    return jnp.where(nan, jnp.float32(jnp.nan), acc)
