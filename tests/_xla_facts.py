"""Facts about the XLA that runs the tests, measured, for tests whose oracle depends on them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


@functools.cache
def cpu_keeps_float32_in_float16_fusions() -> bool:
    """Whether ``jit(exp(x) / exp(x))`` at float16 x = 12 is 1 (the fusion kept exp in float32:
    XLA:CPU up to jax 0.10) rather than inf / inf = NaN (each result stored in float16, as a GPU
    kernel does: XLA:CPU from jax 0.11, seen on 0.11.2)."""
    x = jnp.full((2,), 12.0, jnp.float16)
    return bool(np.all(np.isfinite(np.asarray(jax.jit(lambda v: jnp.exp(v) / jnp.exp(v))(x)))))
