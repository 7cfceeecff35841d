"""Train steps the memory tests measure beside the package's own ``stack_step``: a tanh MLP
regressor and a plain JAX + optax step around a built-in model's loss. Only the tests build
them (the ``[memory]`` experiment runs ``stack_step``), so they live here."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab.memory._builtin import activation_bytes, example_batch
from precisionlab.memory._steps import BuiltStep
from precisionlab.mixed import get_policy


def mlp_step(
    *,
    sizes: tuple[int, ...] = (256, 512, 512, 10),
    batch: int = 256,
    policy: str = "f32",
    optimizer: str = "adam",
    microbatches: int = 1,
    seed: int = 0,
) -> BuiltStep:
    """A tanh MLP regressing zeros with mean squared error.

    Saved per hidden layer: tanh output and 1 - tanh^2 (``micro x width`` in the compute dtype);
    plus the float32 residual of the loss (``micro x sizes[-1]``).
    """
    pol = get_policy(policy)
    keys = jax.random.split(jax.random.key(seed), len(sizes))
    params = [
        {
            "w": (jax.random.normal(k, (a, b)) / np.sqrt(a)).astype(pol.param_dtype),
            "b": jnp.zeros((b,), pol.param_dtype),
        }
        for k, a, b in zip(keys[1:], sizes[:-1], sizes[1:], strict=True)
    ]
    x = jax.random.normal(keys[0], (batch, sizes[0]), jnp.float32)
    dtype = pol.compute_dtype

    def loss_fn(p: list[dict[str, jax.Array]], xb: jax.Array) -> jax.Array:
        h = xb.astype(dtype)
        for i, layer in enumerate(p):
            h = h @ layer["w"] + layer["b"]
            if i < len(p) - 1:
                h = jnp.tanh(h)
        return jnp.mean(jnp.square(h.astype(jnp.float32)))

    micro = batch // microbatches
    e = np.dtype(dtype).itemsize
    activations = sum(2 * micro * w * e for w in sizes[1:-1]) + micro * sizes[-1] * 4
    what = f"tanh MLP {list(sizes)}, batch {batch}, {pol}, {optimizer}"
    return BuiltStep.of(loss_fn, params, x, pol, optimizer, microbatches, activations, what)


def plain_step(model: Any, *, batch: int, policy: str = "f32", seed: int = 0) -> BuiltStep:
    """A plain JAX + optax Adam step around ``model.loss_fn(policy)``."""
    pol = get_policy(policy)
    loss_and_aux = model.loss_fn(pol)

    def loss_fn(params: Any, b: Any) -> jax.Array:
        return loss_and_aux(params, b)[0]

    params = pol.cast_to_param(model.init(jax.random.PRNGKey(seed)))
    saved = activation_bytes(model, batch, pol)
    what = f"built-in {model.name}, batch {batch}, {pol}, adam"
    return BuiltStep.of(loss_fn, params, example_batch(model, batch), pol, "adam", 1, saved, what)
