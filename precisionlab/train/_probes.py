"""What the in-step matmul instruments (:mod:`precisionlab.train._recipe_metrics`,
:mod:`precisionlab.train.gemm_stats`) share: the loss as the step differentiates it, the
tapping rule whose backward pass fills a zero probe with its sums, and the gradients of the
probes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from precisionlab.hardware import ConvGemm
from precisionlab.hardware._conv import from_params as conv_plan
from precisionlab.intercept import Context
from precisionlab.intercept import _boundary as boundary
from precisionlab.recipes import Recipe
from precisionlab.train._step import normalize_loss_fn

__all__ = ["Dot", "Sums", "TapRule", "probe_grads", "scaled_loss"]

#: A matmul (or convolution) of the tapped site's operands: ``(lhs, rhs) -> out``.
Dot = Callable[[jax.Array, jax.Array], jax.Array]
#: What a tap sums into its probe: ``(lhs, rhs, out_grad) -> float32 [3, width]``.
Sums = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


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


@dataclasses.dataclass(frozen=True)
class TapRule:
    """An interception rule on float matmuls and convolutions: each runs as :meth:`tap`'s
    ``dot`` (the recipe's, as the step runs it), and the backward pass returns
    ``sums(lhs, rhs, out_grad)`` as the cotangent of the site's ``probe`` state (read with
    :func:`probe_grads`). Other products run as written."""

    recipe: Recipe
    primitives: tuple[str, ...] = boundary.PRODUCTS

    def tap(self, ctx: Context, params: dict, plan: ConvGemm | None) -> tuple[Dot, Sums]:
        """The site's ``(dot, sums)``: ``params`` are the primitive's (``dimension_numbers``,
        ``preferred_element_type``, a convolution's window); ``plan``, a convolution's GEMM
        over its patches (None for a matmul)."""
        raise NotImplementedError

    def apply(self, ctx: Context, lhs: jax.Array, rhs: jax.Array, **params: Any) -> list:
        if not (
            jnp.issubdtype(lhs.dtype, jnp.floating) and jnp.issubdtype(rhs.dtype, jnp.floating)
        ):
            return ctx.original(lhs, rhs)
        conv = ctx.site.primitive == boundary.CONV
        dot, sums = self.tap(ctx, params, conv_plan(lhs.shape, rhs.shape, params) if conv else None)

        @jax.custom_vjp
        def tapped(a: jax.Array, b: jax.Array, probe: jax.Array) -> jax.Array:
            return dot(a, b)

        def fwd(
            a: jax.Array, b: jax.Array, probe: jax.Array
        ) -> tuple[jax.Array, tuple[jax.Array, jax.Array, Callable]]:
            y, vjp = jax.vjp(dot, a, b)
            return y, (a, b, vjp)

        def bwd(
            res: tuple[jax.Array, jax.Array, Callable], g: jax.Array
        ) -> tuple[jax.Array, jax.Array, jax.Array]:
            a, b, vjp = res
            da, db = vjp(g)
            return da, db, sums(a, b, g)

        tapped.defvjp(fwd, bwd)
        return [tapped(lhs, rhs, ctx.state["probe"])]
