"""Two 4-bit codes per byte (int4, uint4, fp4 / E2M1 codes).

Layout: along the last axis, element ``2i`` goes to the low nibble of byte ``i`` and element
``2i + 1`` to its high nibble (the order of ml_dtypes' and most kernels' int4 packing). An odd
length leaves the last high nibble zero; :func:`unpack` takes the true length to drop it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["pack", "unpack"]


def pack(codes: jax.Array) -> jax.Array:
    """Pack 4-bit codes (any unsigned/int dtype, values 0..15) two per byte.

    Args:
      codes: integer array of shape ``(..., n)``; only the low 4 bits are kept.

    Returns:
      uint8 array of shape ``(..., ceil(n / 2))``.
    """
    codes = jnp.asarray(codes)
    if not jnp.issubdtype(codes.dtype, jnp.integer):
        raise TypeError(f"pack takes integer codes, got dtype {codes.dtype}")
    if codes.ndim == 0:
        raise ValueError("pack needs at least one axis, got a scalar")
    nib = codes.astype(jnp.uint8) & jnp.uint8(0x0F)
    n = nib.shape[-1]
    if n % 2:
        nib = jnp.pad(nib, [(0, 0)] * (nib.ndim - 1) + [(0, 1)])
    pairs = nib.reshape(*nib.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << jnp.uint8(4))


def unpack(packed: jax.Array, n: int) -> jax.Array:
    """Inverse of :func:`pack`: uint8 ``(..., ceil(n / 2))`` -> uint8 codes ``(..., n)``."""
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8:
        raise TypeError(f"unpack takes uint8 bytes, got dtype {packed.dtype}")
    if not isinstance(n, int) or n < 0 or (n + 1) // 2 != packed.shape[-1]:
        raise ValueError(
            f"n={n!r} does not match {packed.shape[-1]} packed bytes (need ceil(n/2) bytes)"
        )
    low = packed & jnp.uint8(0x0F)
    high = packed >> jnp.uint8(4)
    both = jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], -1)
    return both[..., :n]
