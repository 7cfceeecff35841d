"""Accumulator emulation: GEMM partial sums kept to m mantissa bits, optionally promoted.

A *study model* (``accumulate="sequential"``), not hardware: no tensor core rounds after every
product. On the H100 captures its best setting matches 15% of outputs at K = 256 and 6% at
K = 1024; :mod:`precisionlab.hardware` (``accumulate="h100-fast"``, ``"h100-cublaslt"``)
matches all.

Model (stated exactly, so a scalar reference can check it): products ``a_k * b_k`` are
float32 (exact for products of 8-bit or narrower elements); each partial sum
``s + a_k * b_k`` is computed exactly and rounded once to ``m`` mantissa bits (fraction
bits, float32's exponent range), to nearest even or toward zero. With ``promote_every=N``,
after every N products the narrow partial sum is added into a float32 accumulator (rounded
to nearest even) and restarts from zero, as DeepSeek-V3 (section 3.3.2) does with N = 128
on H800 tensor cores, whose FP8 accumulation it measured at about 14 bits.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["accumulate", "batched_gemm", "round_mantissa"]

_ABS = np.uint32(0x7FFFFFFF)


def _bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.uint32)


def _float(b: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(b, jnp.float32)


def _trunc(x: jax.Array, m: int) -> jax.Array:
    mask = np.uint32((0xFFFFFFFF << (23 - m)) & 0xFFFFFFFF)
    return _float(_bits(x) & mask)


def round_mantissa(hi: jax.Array, lo: jax.Array, m: int, mode: str) -> jax.Array:
    """The exact value ``hi + lo`` (``hi = fl32(hi + lo)``, ``|lo| <= ulp(hi) / 2``, as
    TwoSum returns) rounded once to ``m`` mantissa bits: ``"nearest_even"`` or
    ``"toward_zero"``. Inf and NaN pass through."""
    drop = 23 - m
    b = _bits(hi)
    special = (b & _ABS) >= np.uint32(0x7F800000)
    t = _trunc(hi, m)
    rbits = b & np.uint32((1 << drop) - 1)  # the dropped fraction bits of |hi|
    opposite = (lo != 0) & ((lo < 0) != (hi < 0))
    same = (lo != 0) & ~opposite
    if mode == "toward_zero":
        # hi exactly on the m-bit grid but the true value is slightly smaller in magnitude:
        # one m-bit step toward zero (the truncation of hi's float32 predecessor).
        pred = _trunc(_float(b - np.uint32(1)), m)
        out = jnp.where((rbits == 0) & opposite & (hi != 0), pred, t)
    else:
        half = np.uint32(1 << (drop - 1))
        lsb = (b >> drop) & np.uint32(1)
        up = (rbits > half) | ((rbits == half) & (same | ((lo == 0) & (lsb == 1))))
        step = np.uint32(1 << drop)
        out = _float(jnp.where(up, (b & ~np.uint32(step - 1)) + step, b & ~np.uint32(step - 1)))
    return jnp.where(special, hi, out)


def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    s = a + b
    bb = s - a
    err = (a - (s - bb)) + (b - bb)
    return s, err


def accumulate(
    a: jax.Array, b: jax.Array, bits: int, rounding: str = "nearest_even",
    promote_every: int | None = None,
) -> jax.Array:  # fmt: skip
    """``einsum("bmk,bnk->bmn", a, b)`` with an m-bit accumulator (see the module docstring).

    a: float32 (B, M, K); b: float32 (B, N, K). Returns float32 (B, M, N). Runs a scan over
    K (emulation: K sequential steps), so it is for studies, not speed.
    """
    if rounding not in ("nearest_even", "toward_zero"):
        raise ValueError(f"unknown rounding {rounding!r}; allowed: nearest_even, toward_zero")
    a = jnp.moveaxis(a.astype(jnp.float32), -1, 0)[:, :, :, None]  # (K, B, M, 1)
    b = jnp.moveaxis(b.astype(jnp.float32), -1, 0)[:, :, None, :]  # (K, B, 1, N)
    k = a.shape[0]
    shape = (a.shape[1], a.shape[2], b.shape[3])
    every = promote_every or 0

    def step(carry: tuple[jax.Array, ...], inp: tuple[jax.Array, ...]) -> tuple[Any, None]:
        s, f, i = carry
        ak, bk = inp
        hi, lo = _two_sum(s, ak * bk)
        s = round_mantissa(hi, lo, bits, rounding)
        if every:
            promote = (i + 1) % every == 0
            f = jnp.where(promote, f + s, f)
            s = jnp.where(promote, jnp.float32(0.0), s)
        return (s, f, i + 1), None

    zero = jnp.zeros(shape, jnp.float32)
    (s, f, _), _ = lax.scan(step, (zero, zero, jnp.int32(0)), (a, b), length=k)
    return f + s if every else s


def batched_gemm(
    a: jax.Array,
    b: jax.Array,
    bits: int | None,
    rounding: str = "nearest_even",
    promote_every: int | None = None,
) -> jax.Array:
    """``einsum("bmk,bnk->bmn", a, b)`` in float32: one einsum with float32 accumulation at
    HIGHEST precision when ``bits`` is None, else :func:`accumulate`'s m-bit model with
    ``bits``, ``rounding`` and ``promote_every`` (a recipe's ``accumulate_*`` settings)."""
    if bits is None:
        return jnp.einsum(
            "bmk,bnk->bmn", a, b, precision=lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )  # fmt: skip
    return accumulate(a, b, bits, rounding, promote_every)
