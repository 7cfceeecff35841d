"""What XLA's GPU backend computes for one operation of a 16-bit program (emulate's model).

Established against an H100 (jax/jaxlib 0.11.2, captures in tests/data/h100_emulate.npz):

- every HLO operation's result is rounded to the dtype the program gives it; float32
  operations of a 16-bit program (``jnp.mean``'s and softmax's float32 sums) stay float32;
- elementwise arithmetic is computed in float32 on the (exact) widened operands and rounded
  once: + - * / sqrt are then correctly rounded in the 16-bit format (float32 carries more
  than twice the 16-bit mantissa plus two bits, so the double rounding is innocuous);
- transcendental functions of 16-bit operands return the correctly rounded 16-bit value
  (modelled with a 65536-entry table computed in float64 numpy); the CPU's float32
  approximations (``exp`` of XLA:CPU is off by an ulp now and then) would otherwise show
  through at the 16-bit rounding;
- ``integer_pow`` is the chain of multiplies JAX lowers it to, each rounded;
- ``logistic`` (``jax.nn.sigmoid``) is ``1 / (1 + exp(-x))``, each operation rounded: XLA's
  LogisticExpander pass rewrites it so on the GPU (from XLA's pipeline; no capture checks it);
- a division is a true division: XLA:CPU rewrites ``a / broadcast(b)`` into ``a * (1/b)``,
  XLA:GPU does not (softmax's normaliser), so the divisor is hidden behind an
  ``optimization_barrier`` here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from precisionlab.intercept import _boundary as boundary

__all__ = ["divide", "integer_power", "is_narrow", "logistic", "tabled_unary"]


def is_narrow(dtype: Any) -> bool:
    """A 16-bit float dtype (the formats the model's tables cover)."""
    dt = np.dtype(dtype)
    return dt in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


@functools.cache
def _table(name: str, dtype_name: str) -> np.ndarray:
    """Codes of the correctly rounded ``name(x)`` for every 16-bit code x (uint16[65536])."""
    dt = np.dtype(getattr(ml_dtypes, dtype_name, None) or dtype_name)
    with np.errstate(all="ignore"):  # NaN codes and out-of-domain arguments give NaN
        x = np.arange(65536, dtype=np.uint16).view(dt).astype(np.float64)
        y = boundary.TRANSCENDENTAL[name](x)
        # float64 -> 16 bits directly (one rounding; ml_dtypes rounds bfloat16 from float64)
        return np.asarray(y).astype(dt).view(np.uint16)


def tabled_unary(name: str, x: jax.Array, dtype: Any) -> jax.Array:
    """``name(x)`` correctly rounded to the 16-bit ``dtype``; ``x`` holds values of ``dtype``
    (any float dtype); the result has ``x``'s dtype."""
    dt = np.dtype(dtype)
    codes = lax.bitcast_convert_type(x.astype(dt), jnp.uint16)
    table = jnp.asarray(_table(name, dt.name))
    out = lax.bitcast_convert_type(table[codes.astype(jnp.int32)], dt)
    return out.astype(x.dtype)


def integer_power(x: jax.Array, y: int, rnd: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """``x ** y`` as JAX lowers ``integer_pow`` (square and multiply, then one reciprocal for
    a negative y), each product rounded by ``rnd``."""
    if y == 0:
        return jnp.ones_like(x)
    base, n, acc = x, abs(y), None
    while n:
        if n & 1:
            acc = base if acc is None else rnd(acc * base)
        n >>= 1
        if n:
            base = rnd(base * base)
    assert acc is not None
    return rnd(1 / acc) if y < 0 else acc


def divide(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a / b`` correctly rounded in float32, with the divisor out of reach of XLA:CPU's
    rewrite of a division by a broadcast into a multiply by its reciprocal."""
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    a32 = jnp.broadcast_to(a.astype(jnp.float32), shape)
    b32 = lax.optimization_barrier(jnp.broadcast_to(b.astype(jnp.float32), shape))
    return a32 / b32


def logistic(x: jax.Array, dtype: Any, rnd: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """``1 / (1 + exp(-x))`` with ``exp`` correctly rounded to the 16-bit ``dtype`` and the
    sum and the quotient rounded by ``rnd`` (XLA's LogisticExpander)."""
    e = tabled_unary(boundary.EXP, -x, dtype)
    d = rnd(e.astype(jnp.float32) + 1.0)
    return rnd(divide(jnp.ones_like(d, jnp.float32), d))
