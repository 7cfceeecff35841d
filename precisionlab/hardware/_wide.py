"""The wide step: aligned sums wider than int32, in two int32 limbs (no x64 needed).

Used only where a step keeps more fraction bits than the int32 kernel holds (``_kernel.MAX_F``),
e.g. Blackwell's block-scaled FP4 step with 35 fraction bits. Every addend is an int32
significand ``x`` with value ``x * 2**(e - p)`` (``p`` its own fraction bits, ``e`` its
alignment exponent). Cut toward zero to the grid ``2**(E - F)`` of the largest exponent ``E``,
it becomes ``hi * 2**B + lo`` with both limbs carrying the addend's sign and ``|lo| < 2**B``;
the limbs are summed separately (a few dozen addends cannot overflow either), the carry is
moved from ``lo`` to ``hi``, and the exact sum is cut to float32.

Bit budget: an addend's cut magnitude must stay below ``2**(B + 31 - log2(n))`` for ``n``
addends; :func:`check_budget` raises where a step could exceed it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from precisionlab.hardware import _kernel as _k
from precisionlab.hardware._step import Step

__all__ = ["B", "aligned_sum", "check_budget", "limbs", "step_apply", "sum_to_f32"]

B = 24  # the low limb's width
_MASK = (1 << B) - 1


def check_budget(max_bits: int, n: int, what: str) -> None:
    """Raise ValueError if ``n`` addends of up to ``max_bits`` bits (cut magnitude) could
    overflow the two-limb sum."""
    room = 31 - math.ceil(math.log2(max(n, 2)))
    if max_bits - B > room or B > room:
        raise ValueError(
            f"{what}: {n} addends of {max_bits} bits exceed the two-limb kernel "
            f"(at most {B + room} bits for {n} addends)"
        )


def _u(v: jax.Array) -> jax.Array:
    return jnp.asarray(v).astype(jnp.uint32)


def limbs(x: jax.Array, s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``trunc(x * 2**s)`` (toward zero) as int32 limbs ``(hi, lo)``: value ``hi * 2**B + lo``,
    both with the sign of ``x``, ``|lo| < 2**B``. ``x`` int32 with ``|x| < 2**31``, ``s`` int32
    (any value; the caller keeps ``|x| * 2**s`` within the budget)."""
    mag = _u(jnp.abs(x))
    right = lax.shift_right_logical(mag, _u(jnp.clip(-s, 0, 31)))  # s < 0
    hi_mid = lax.shift_right_logical(mag, _u(jnp.clip(B - s, 0, 31)))  # 0 <= s < B
    lo_mid = lax.shift_left(mag, _u(jnp.clip(s, 0, 31))) & _MASK  # low bits survive the wrap
    hi_left = lax.shift_left(mag, _u(jnp.clip(s - B, 0, 31)))  # s >= B
    hi = jnp.where(s < 0, lax.shift_right_logical(right, jnp.uint32(B)),
                   jnp.where(s < B, hi_mid, hi_left))  # fmt: skip
    lo = jnp.where(s < 0, right & _MASK, jnp.where(s < B, lo_mid, 0))
    hi, lo = hi.astype(jnp.int32), lo.astype(jnp.int32)
    neg = x < 0
    return jnp.where(neg, -hi, hi), jnp.where(neg, -lo, lo)


def sum_to_f32(hi: jax.Array, lo: jax.Array, q: jax.Array, bits: int) -> jax.Array:
    """float32 of ``sum(hi) * 2**B + sum(lo)`` (sums over axis 0) times ``2**q``, cut toward
    zero to ``bits`` significant bits and to float32's subnormal grid (beyond range: inf)."""
    hi = jnp.sum(hi, axis=0)
    lo = jnp.sum(lo, axis=0)
    hi = hi + (lo >> B)  # arithmetic shift: floor, so that 0 <= lo < 2**B after the mask
    lo = lo & _MASK
    neg = hi < 0
    borrow = lo != 0
    mhi = jnp.where(neg, -hi - borrow.astype(jnp.int32), hi)
    mlo = jnp.where(neg & borrow, (1 << B) - lo, lo)
    return _k.to_f32(neg, mhi, mlo, q, bits, B)


def aligned_sum(
    xs: list[jax.Array], es: list[jax.Array], ps: list[int], fraction_bits: int, bits: int
) -> jax.Array:
    """One fused sum: addends ``xs[i] * 2**(es[i] - ps[i])`` (each (n_i, ..., M, N) int32 or
    broadcastable), aligned to the largest exponent over all of them, cut toward zero to
    ``fraction_bits`` below it, summed exactly, cut to ``bits`` (float32 (..., M, N))."""
    big = jnp.max(jnp.concatenate([jnp.max(e, axis=0, keepdims=True) for e in es]), axis=0)
    his, los = [], []
    for x, e, p in zip(xs, es, ps, strict=True):
        h, lo = limbs(x, fraction_bits - p - (big[None] - e))
        his.append(h)
        los.append(lo)
    return sum_to_f32(jnp.concatenate(his), jnp.concatenate(los), big - fraction_bits, bits)


def step_apply(
    am: jax.Array,
    ae: jax.Array,
    bm: jax.Array,
    be: jax.Array,
    c: jax.Array,
    step: Step,
    pa: int,
    pb: int,
) -> jax.Array:
    """``_kernel.step_apply`` for ``fraction_bits > _kernel.MAX_F``, in two limbs (the
    significands decoded without a pre-shift: ``_kernel.shift_for`` gives 0)."""
    f = step.fraction_bits
    w = am.shape[0]
    check_budget(f + 2, w + 1, f"Step.fraction_bits={f}")
    x = am * bm  # exact: at most 2 * 11 bits
    es = ae + be
    es = jnp.broadcast_to(es, x.shape)
    if not step.accumulator_in_alignment:
        return c + aligned_sum([x], [es], [pa + pb], f, step.result_bits)
    cm, ce = _k.decode_f32(c)
    out = aligned_sum([x, cm[None]], [es, ce[None]], [pa + pb, 23], f, step.result_bits)
    return jnp.where(jnp.isfinite(c), out, c)
