"""Forcing a compute dtype's rounding and overflow at op boundaries.

XLA may carry more precision or range than an array's dtype says: on CPU, bf16/fp16 ops can run in
float32 and, with ``xla_allow_excess_precision`` (on by default), a convert pair inside a fusion may
be elided. :func:`enforce` pins the value an op's result would have in the compute dtype:

- IEEE-style formats (float16, bfloat16, float32, float8_e5m2): ``lax.reduce_precision`` with the
  format's exponent and mantissa widths, which XLA never elides; overflow gives inf. XLA's
  reduce_precision flushes the target's subnormals to zero, so the subnormal range is rounded
  separately (exact scale-round-unscale in float32): float16 keeps its subnormals as on a GPU.
  The transpose rounds the cotangent the same way, so the backward pass is rounded at the same
  boundaries.
- Other formats (float8_e4m3fn: no inf, NaN on overflow): the project's codec
  (``precisionlab.bits.round_to_format``), with a straight-through gradient rounded the same way.
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab import bits
from precisionlab.formats import FloatFormat, get_format

__all__ = ["enforce", "enforce_tree", "ieee_widths", "uses_reduce_precision"]

T = TypeVar("T")

#: dtype names of the formats whose specials follow IEEE (their widths: precisionlab.formats)
_IEEE = ("float32", "bfloat16", "float16", "float8_e5m2", "float64")


def ieee_widths(dtype: Any) -> tuple[int, int] | None:
    """(exponent_bits, mantissa_bits) if ``dtype`` is IEEE-style, else None."""
    name = np.dtype(dtype).name
    if name not in _IEEE:
        return None
    fmt = get_format(name)
    assert isinstance(fmt, FloatFormat)
    return fmt.exponent_bits, fmt.mantissa_bits


def uses_reduce_precision(dtype: Any) -> bool:
    """Whether :func:`enforce` uses ``lax.reduce_precision`` for ``dtype`` (else the codec)."""
    return ieee_widths(dtype) is not None


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _codec_round(x: jax.Array, name: str) -> jax.Array:
    return bits.round_to_format(x.astype(jnp.float32), name).astype(x.dtype)


def _codec_round_fwd(x: jax.Array, name: str) -> tuple[jax.Array, None]:
    return _codec_round(x, name), None


def _codec_round_bwd(name: str, _: None, g: jax.Array) -> tuple[jax.Array]:
    return (_codec_round(g, name),)


_codec_round.defvjp(_codec_round_fwd, _codec_round_bwd)


def enforce(x: jax.Array, dtype: Any = None) -> jax.Array:
    """Round ``x`` to ``dtype`` (default: ``x.dtype``) and keep ``x``'s dtype.

    The result holds exactly the value ``x`` takes when stored in ``dtype``, with the format's
    overflow (inf for IEEE formats; NaN for float8_e4m3fn) and subnormals. A no-op for float32
    and wider when ``dtype`` is ``x``'s own dtype (XLA never widens those).
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    target = np.dtype(x.dtype if dtype is None else dtype)
    if target.itemsize >= 4 and target == np.dtype(x.dtype):
        return x
    widths = ieee_widths(target)
    if widths is not None:
        return _ieee_round(x, *widths)
    return _codec_round(x, target.name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _ieee_round(x: jax.Array, exponent_bits: int, mantissa_bits: int) -> jax.Array:
    # XLA's reduce_precision flushes the target's subnormals to zero (checked on CPU), whereas a
    # GPU computing in float16 keeps them. Below the smallest normal the format's grid is uniform
    # (spacing 2**(emin - m)), so rounding there is an exact scale, round-half-even, unscale in
    # float32. Formats whose subnormals are float32 subnormals (bfloat16) are left to
    # reduce_precision: XLA on CPU flushes float32 subnormals anyway.
    wide = jnp.promote_types(x.dtype, jnp.float32)
    xf = x.astype(wide)
    rounded = jax.lax.reduce_precision(xf, exponent_bits=exponent_bits, mantissa_bits=mantissa_bits)
    emin = 2 - 2 ** (exponent_bits - 1)
    if emin - mantissa_bits >= np.finfo(np.float32).minexp:
        up = float(2.0 ** (mantissa_bits - emin))
        sub = jnp.round(xf * jnp.asarray(up, wide)) * jnp.asarray(1.0 / up, wide)
        tiny = jnp.asarray(2.0**emin, wide)
        rounded = jnp.where(jnp.abs(xf) < tiny, sub, rounded)
    return rounded.astype(x.dtype)


def _ieee_round_fwd(x: jax.Array, exponent_bits: int, mantissa_bits: int) -> tuple[jax.Array, None]:
    return _ieee_round(x, exponent_bits, mantissa_bits), None


def _ieee_round_bwd(
    exponent_bits: int, mantissa_bits: int, _: None, g: jax.Array
) -> tuple[jax.Array]:
    # Rounding is treated as linear (as lax.reduce_precision is): the cotangent is rounded to the
    # same format, as the backward pass of a float16 network would round it.
    return (_ieee_round(g, exponent_bits, mantissa_bits),)


_ieee_round.defvjp(_ieee_round_fwd, _ieee_round_bwd)


def enforce_tree(tree: T, dtype: Any = None) -> T:
    """:func:`enforce` on every floating array leaf; other leaves (an Equinox module's
    activation function, its Python numbers) pass through unchanged."""

    def one(x: Any) -> Any:
        floating = hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
        return enforce(x, dtype) if floating and not isinstance(x, type) else x

    return jax.tree_util.tree_map(one, tree)
