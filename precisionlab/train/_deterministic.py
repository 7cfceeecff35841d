"""Fixed-order matmuls and sums: the same bits on any CPU (``TrainConfig.deterministic``).

XLA on the CPU picks how to sum a matmul's products and a reduction's terms by the machine:
its matmul kernels block K by the vector width, and a large reduction is split over the
threads, so the result of ``jnp.sum`` changes with the number of cores the process may use
(measured: a sum of 8,192 float32 values on one core and on two differs). :func:`fixed_order`
rewrites a function's floating ``dot_general``, ``conv_general_dilated`` (as the GEMM over its
patches, K = kernel taps then input channels, as :class:`precisionlab.hardware.ConvGemm` lays
it out) and ``reduce_sum`` into elementwise products and a pairwise sum whose order is fixed
by the shapes alone:

- the terms along the summed axis are zero-padded to a power of two, then halved
  ``log2(K)`` times: ``s[i] = t[i] + t[i + K/2]`` (every addition an elementwise IEEE add,
  whatever the vectorization);
- a matmul's products are computed in float32 (the inputs widened exactly) and each rounded
  before it is summed (a select between product and sum: XLA fuses a multiply into its
  consumer and LLVM would contract the pair into an FMA on a CPU with one and not on
  another); the result is rounded once to the output dtype;
- a reduction typed in a 16-bit format adds in that format, each partial sum rounded (as XLA
  does), in the same fixed order.

Elementwise functions (``exp``, ``tanh``, an optimizer's ``a * m + b * g``) are XLA's own
code, the same on every x86-64 CPU with FMA (all since about 2013); a CPU without FMA
(``XLA_FLAGS=--xla_cpu_max_isa=AVX``) computes some of them differently. The cost is memory
and time: a matmul holds its M x K x N products (blocked to :data:`BLOCK` elements).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from precisionlab.hardware._conv import from_params as conv_plan
from precisionlab.hardware._gemm import BATCHED_GEMM_DIMS
from precisionlab.intercept import Context, intercept
from precisionlab.intercept import _boundary as boundary

__all__ = ["BLOCK", "fixed_order", "pairwise_dot", "pairwise_sum"]

#: The most products a matmul holds at once (float32 elements: 64 MiB); larger ones run in
#: blocks of rows.
BLOCK = 1 << 24


def _halve(x: jax.Array) -> jax.Array:
    """The pairwise sum of ``x`` along its last axis (zero-padded to a power of two)."""
    k = x.shape[-1]
    if k == 0:
        return jnp.zeros(x.shape[:-1], x.dtype)
    width = 1 << max(0, (k - 1).bit_length())
    if width != k:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - k)])
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def pairwise_sum(x: jax.Array, axes: Sequence[int]) -> jax.Array:
    """``jnp.sum(x, axes)`` (``axes``: non-negative, as ``lax.reduce_sum`` takes them) in the
    fixed pairwise order of the module docstring, in ``x``'s dtype."""
    axes = tuple(sorted(int(a) for a in axes))
    if not axes:
        return x
    keep = [d for d in range(x.ndim) if d not in axes]
    moved = jnp.transpose(x, (*keep, *axes))
    flat = moved.reshape(*(x.shape[d] for d in keep), -1)
    return _halve(flat)


def _products_sum(a: jax.Array, b: jax.Array) -> jax.Array:
    """(B, M, N) float32 sums of a (B, M, K) x b (B, K, N), products rounded, then halved."""
    prods = a[:, :, :, None] * b[:, None, :, :]  # (B, M, K, N)
    # XLA's CPU compiler drops an optimization barrier and fuses the multiply into the adds
    # that consume it, where LLVM contracts the two into an FMA wherever the CPU has one
    # (measured, jax 0.6.2 and 0.10.2 on an AVX-512 CPU: the first halving computed
    # fma(a, b, p), the documented order only under --xla_cpu_max_isa=AVX). No add contracts
    # through a select, and this one changes no bit but a NaN's payload.
    prods = jnp.where(jnp.isnan(prods), jnp.float32(jnp.nan), prods)
    return _halve(jnp.moveaxis(prods, 2, -1))


def pairwise_dot(
    lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, out_dtype: Any
) -> jax.Array:  # fmt: skip
    """``lax.dot_general(lhs, rhs, dimension_numbers)`` with float32 products summed in the
    fixed pairwise order, rounded once to ``out_dtype``; the output layout is dot_general's
    (batch, lhs free, rhs free)."""
    (lc, rc), (lb, rb) = dimension_numbers
    lf = [d for d in range(lhs.ndim) if d not in (*lc, *lb)]
    rf = [d for d in range(rhs.ndim) if d not in (*rc, *rb)]
    bshape = [lhs.shape[d] for d in lb]
    nb = int(np.prod(bshape, dtype=np.int64))
    m = int(np.prod([lhs.shape[d] for d in lf], dtype=np.int64))
    n = int(np.prod([rhs.shape[d] for d in rf], dtype=np.int64))
    k = int(np.prod([lhs.shape[d] for d in lc], dtype=np.int64))
    a = jnp.transpose(lhs, (*lb, *lf, *lc)).reshape(nb, m, k).astype(jnp.float32)
    b = jnp.transpose(rhs, (*rb, *rc, *rf)).reshape(nb, k, n).astype(jnp.float32)
    rows = max(1, BLOCK // max(1, nb * k * n))
    if rows >= m:
        out = _products_sum(a, b)
    else:  # blocks of rows, each independent of the others (the order within is fixed)
        pad = -m % rows
        a = jnp.pad(a, ((0, 0), (0, pad), (0, 0)))
        blocks = jnp.moveaxis(a.reshape(nb, -1, rows, k), 1, 0)
        out = lax.map(lambda blk: _products_sum(blk, b), blocks)  # (blocks, B, rows, N)
        out = jnp.moveaxis(out, 0, 1).reshape(nb, -1, n)[:, :m]
    shape = (*bshape, *(lhs.shape[d] for d in lf), *(rhs.shape[d] for d in rf))
    return out.reshape(shape).astype(out_dtype)


def _floating(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


@dataclasses.dataclass(frozen=True)
class _FixedOrder:
    """The interception rule: floating ``dot_general``, ``conv_general_dilated`` (the GEMM over
    its patches, :class:`precisionlab.hardware.ConvGemm`) and ``reduce_sum`` in fixed order."""

    primitives: tuple[str, ...] = (*boundary.PRODUCTS, boundary.REDUCE_SUM)
    emits = False

    def apply(self, ctx: Context, *operands: jax.Array, **params: Any) -> list[jax.Array]:
        out_dtype = jnp.dtype(ctx.site.out_dtype)
        if not jnp.issubdtype(out_dtype, jnp.floating) or not all(_floating(x) for x in operands):
            return list(ctx.original(*operands))
        if ctx.site.primitive == boundary.DOT_GENERAL:
            dn = params["dimension_numbers"]
            return [pairwise_dot(operands[0], operands[1], dn, out_dtype)]
        if ctx.site.primitive == boundary.CONV:
            lhs, rhs = operands
            plan = conv_plan(lhs.shape, rhs.shape, params)
            y = pairwise_dot(plan.patches(lhs), plan.kernel_rows(rhs), BATCHED_GEMM_DIMS, out_dtype)
            return [plan.output(y)]
        return [pairwise_sum(operands[0], params["axes"]).astype(out_dtype)]


def fixed_order(fn: Callable) -> Callable:
    """``fn`` with every floating ``dot_general``, ``conv_general_dilated`` and ``reduce_sum``
    (its own, those of the functions it calls and of its gradient, when ``fn`` computes one)
    in the fixed order of :mod:`precisionlab.train._deterministic`; composes with
    ``jax.jit``."""
    return intercept(fn, _FixedOrder())
