"""An example for `precisionlab emulate-check docs/guides/emulate_example.py`."""

import jax.numpy as jnp


def model(x):
    ratio = jnp.exp(x) / jnp.exp(x)  # 1 in float32; a float16 kernel overflows exp(x) > 65504
    return jnp.sum(ratio * x)


def inputs():
    return (jnp.linspace(-12, 12, 64, dtype=jnp.float16),)
