"""What the in-step matmul instruments (:mod:`precisionlab.train.recipe_metrics`,
:mod:`precisionlab.train.gemm_stats`) share: the loss as the step differentiates it, and the
gradients of zero probes that a tapping rule's backward pass fills with its sums."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from precisionlab.train.step import normalize_loss_fn

__all__ = ["probe_grads", "scaled_loss"]


def scaled_loss(loss_fn: Callable) -> Callable[[Any, Any, Any], jax.Array]:
    """``(params, batch, loss_scale) -> loss_scale.scale(loss)``: the function the train step
    differentiates (its matmuls carry the same names)."""
    f = normalize_loss_fn(loss_fn)

    def scaled(p: Any, b: Any, ls: Any) -> jax.Array:
        loss, _ = f(p, b)
        return ls.scale(loss)

    return scaled


def probe_grads(
    tapped: Any, sites: Sequence[str], width: int, recipe_state: Any, *args: Any, key: Any
) -> dict[str, jax.Array]:
    """The gradient of each site's float32 ``[3, width]`` zero probe through
    ``tapped.call_with_state(state, *args, key=key)``: what the tapping rule's backward pass
    sums into it. Each site's state is its probe and, where ``recipe_state`` has one, its
    recipe state (no gradient flows into that)."""
    rs = jax.lax.stop_gradient(recipe_state or {})

    def run(probes: dict[str, jax.Array]) -> jax.Array:
        state = {n: {"probe": probes[n], **({"recipe": rs[n]} if n in rs else {})} for n in sites}
        return tapped.call_with_state(state, *args, key=key)

    return jax.grad(run)({n: jnp.zeros((3, width), jnp.float32) for n in sites})
