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
subnormal included), and the FFMA is ``RN(acc + p * 2**k)``, computed exactly in int32 by
:func:`precisionlab.hardware.fma_pow2`. The scale promotion is taken from DeepGEMM's source;
it is not checked on hardware.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from precisionlab import hardware as hw
from precisionlab.recipes._scaling import QOperand

__all__ = ["BLOCK", "blockwise_gemm"]

#: DeepGEMM's scaling block along K (``BLOCK_K == 128``, asserted in its kernels).
BLOCK = 128


def _blocks(x: jax.Array) -> jax.Array:
    """(B, R, K) -> (B, K / 128, R, 128)."""
    b, r, k = x.shape
    return jnp.transpose(x.reshape(b, r, k // BLOCK, BLOCK), (0, 2, 1, 3))


def blockwise_gemm(qa: QOperand, qb: QOperand, preset: str) -> jax.Array:
    """float32 (B, M, N) of blockwise-quantized ``qa`` (B, M, K) and ``qb`` (B, N, K)
    (elements E4M3 values, power-of-two block scales with ``block_exp``; K a multiple of
    128) as DeepGEMM's Hopper kernels compute it under ``preset`` (see the module
    docstring)."""
    kw = hw.preset(preset)
    a8 = _blocks(qa.elems.astype(jnp.float8_e4m3fn))  # exact: the elements are E4M3 values
    b8 = _blocks(qb.elems.astype(jnp.float8_e4m3fn))

    def block(a: jax.Array, b: jax.Array) -> jax.Array:
        # (M, 128) x (N, 128): one 128-k chain on the Hopper FP8 step
        return hw.gemm(a, b.T, **kw)

    parts = jax.vmap(jax.vmap(block))(a8, b8)  # (B, K / 128, M, N)

    def per_block(q: QOperand) -> tuple[jax.Array, jax.Array]:
        # the scale exponent (int32) and NaN flag of each (row, block)
        assert q.block_exp is not None and q.block_inv is not None  # blockwise scales
        exp = jnp.broadcast_to(q.block_exp, q.elems.shape)[..., ::BLOCK]
        nan = jnp.isnan(jnp.broadcast_to(q.block_inv, q.elems.shape)[..., ::BLOCK])
        return jnp.moveaxis(exp, -1, 1), jnp.moveaxis(nan, -1, 1)  # (B, K / 128, R)

    ea, na = per_block(qa)
    eb, nb = per_block(qb)
    k = ea[..., :, None] + eb[..., None, :]  # log2 fl32(sa * sb), before its range
    nan = na[..., :, None] | nb[..., None, :]

    def promote(acc: jax.Array, x: tuple[jax.Array, ...]) -> tuple[jax.Array, None]:
        p, kj, nj = x
        return hw.fma_pow2(p, kj, acc, nj), None

    zero = jnp.zeros(parts.shape[:1] + parts.shape[2:], jnp.float32)
    xs = tuple(jnp.moveaxis(t, 1, 0) for t in (parts, k, nan))
    acc, _ = lax.scan(promote, zero, xs)
    return acc
