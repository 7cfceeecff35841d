"""What the built-in models' layers share below the model class: the activation functions and
the policy of a layer kept in float32."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab.mixed import ops
from precisionlab.mixed._policy import Policy

__all__ = ["ACTIVATIONS", "activate", "check_activation", "fp32_compute"]

#: The activations of the built-in models' hidden layers.
ACTIVATIONS: tuple[str, ...] = ("relu", "gelu", "tanh")


def check_activation(name: str) -> None:
    """ValueError unless ``name`` is one of :data:`ACTIVATIONS`."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; allowed: {', '.join(ACTIVATIONS)}")


def activate(name: str, z: jax.Array, pol: Policy) -> jax.Array:
    """Activation ``name`` of ``z`` in ``pol``'s compute dtype, rounded at the op boundary."""
    if name == "relu":
        return ops.relu(z, policy=pol)
    if name == "gelu":
        return ops.gelu(z, policy=pol)
    return ops.boundary(jnp.tanh(z), pol)


def fp32_compute(pol: Policy) -> Policy:
    """``pol`` with a float32 compute dtype (a layer kept in high precision)."""
    return dataclasses.replace(pol, compute_dtype=np.dtype(np.float32))
