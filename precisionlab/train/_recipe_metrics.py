"""What a recipe does to the tensors it quantizes, measured on one batch (at histogram steps).

Per tensor group, pooled over the replaced matmuls: ``x`` (activations: the fprop lhs),
``w`` (weights: the fprop rhs) and ``g`` (output gradients, laid out for the dgrad GEMM):

- ``saturated``: fraction of the elements whose quantized code is the element format's
  largest magnitude while the value exceeded it (clipped);
- ``underflow``: fraction of the nonzero elements that quantize to zero;
- ``sqnr_db``: ``10 log10(sum x^2 / sum (x - Q(x))^2)`` over the group;
- ``log2_scale_min`` / ``log2_scale_max``: range of log2 of the dequantization factors
  (per tensor, row or block: what multiplies the element codes).

Measured by an interception rule beside the recipe's: each matmul runs through the recipe as
in training, and a custom VJP returns the statistics of its three operands as the cotangent
of a per-matmul probe leaf (no side channel). A convolution counts as the GEMM over its
patches the recipe runs: its operands are the patches, the kernel rows and the output
gradient with the output channels along the contraction. The gradients' statistics are
those of the loss's backward pass on this batch (scaled by the loss scale, as the recipe
sees them).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab.hardware import ConvGemm
from precisionlab.intercept import Context, intercept
from precisionlab.recipes import (
    MX,
    WEIGHT_OPERANDS,
    Current,
    Delayed,
    FP4Recipe,
    Recipe,
    Reference,
    canonical_operand,
    dot_general,
)
from precisionlab.recipes._conv import conv_site
from precisionlab.train._probes import Dot, Sums, TapRule, probe_grads, scaled_loss
from precisionlab.train._recipe import TrainRecipe

__all__ = ["GROUPS", "STATS", "measures", "recipe_metrics"]

#: Tensor groups: activations, weights, output gradients.
GROUPS: tuple[str, ...] = ("x", "w", "g")
#: Keys of each group's statistics.
STATS: tuple[str, ...] = ("saturated", "underflow", "sqnr_db", "log2_scale_min", "log2_scale_max")
# per group: elements, saturated, nonzero, underflowed, signal energy, noise energy, -min, max
_N = 8
_E2M1_MAX = 6.0
_E4M3_MAX = 448.0


def _pad(recipe: Recipe, t: jax.Array, kind: str) -> jax.Array:
    for blk in recipe.block_sizes(kind):
        axes = (-1, -2) if recipe.two_d(kind) else (-1,)
        for ax in axes:
            widths = [(0, 0)] * t.ndim
            widths[ax] = (0, -t.shape[ax] % blk)
            t = jnp.pad(t, widths)
    return t


def _elem_max(recipe: Recipe, kind: str) -> float:
    """The largest magnitude of the element format ``recipe`` quantizes ``kind`` into."""
    if isinstance(recipe, Delayed | Current | MX):
        return float(recipe.fmt(kind).max)
    return _E2M1_MAX if recipe.name == "nvfp4" else _E4M3_MAX  # FP4 recipes: see measures


def _stats(
    recipe: Recipe, t: jax.Array, kind: str, scale: jax.Array | None, key: jax.Array | None
) -> jax.Array:
    """The ``_N`` sums of one (B, R, K) operand quantized as ``kind``."""
    t = _pad(recipe, t.astype(jnp.float32), kind)
    q = recipe.quantize(t, kind, scale=scale, key=key)
    dq = q.dequantize()
    a, ad = jnp.abs(t), jnp.abs(dq)
    sat = (jnp.abs(q.elems) >= _elem_max(recipe, kind)) & (a > ad)
    nonzero = t != 0
    factor = jnp.ones((), jnp.float32)
    for f in (q.block_inv, q.row_inv):
        if f is not None:
            factor = factor * f
    lg = jnp.log2(jnp.abs(factor))
    ok = jnp.isfinite(lg)
    return jnp.stack(
        [
            jnp.float32(t.size),
            jnp.sum(sat, dtype=jnp.float32),
            jnp.sum(nonzero, dtype=jnp.float32),
            jnp.sum(nonzero & (dq == 0), dtype=jnp.float32),
            jnp.sum(t * t),
            jnp.sum((t - dq) ** 2),
            jnp.max(jnp.where(ok, -lg, -jnp.inf)),
            jnp.max(jnp.where(ok, lg, -jnp.inf)),
        ]
    )


def _merge(rows: list) -> jax.Array:
    """One group's ``_N`` sums from its operands' (none: an empty group)."""
    if not rows:
        return jnp.concatenate([jnp.zeros(6, jnp.float32), jnp.full(2, -jnp.inf, jnp.float32)])
    if len(rows) == 1:
        return rows[0]
    both = jnp.stack(rows)
    return jnp.concatenate([jnp.sum(both[:, :6], axis=0), jnp.max(both[:, 6:], axis=0)])


@dataclasses.dataclass(frozen=True)
class _MetricsRule(TapRule):
    def tap(self, ctx: Context, params: dict, plan: ConvGemm | None) -> tuple[Dot, Sums]:
        recipe = self.recipe
        rstate = ctx.state.get("recipe")
        key = ctx.site_key()
        kx, kw = ctx.site.roles or WEIGHT_OPERANDS["rhs"]  # the recipe's roles
        scales = (
            (None, None, None) if rstate is None else tuple(rstate["scale"][i] for i in range(3))
        )
        if plan is None:
            dn = params["dimension_numbers"]
            (lc, rc), (lb, rb) = dn
            pet = params.get("preferred_element_type")

            def qdot(a: jax.Array, b: jax.Array) -> jax.Array:
                return dot_general(a, b, dn, preferred_element_type=pet, recipe=recipe,
                                   state=rstate, key=key, weight=(kx, kw))  # fmt: skip

            def operands(a: jax.Array, b: jax.Array, g: jax.Array) -> tuple[jax.Array, ...]:
                # g is (batch, lhs free, rhs free): dgrad contracts the rhs free axes
                g_contract = tuple(range(a.ndim - len(lc), g.ndim))
                return (canonical_operand(a, lc, lb)[0], canonical_operand(b, rc, rb)[0],
                        canonical_operand(g, g_contract, tuple(range(len(lb))))[0])  # fmt: skip

        else:  # a convolution: its GEMM's operands, the patches, kernel rows and (G, M, O_g)

            def qdot(a: jax.Array, b: jax.Array) -> jax.Array:
                return conv_site(a, b, params, recipe, (kx, kw), rstate, key)

            def operands(a: jax.Array, b: jax.Array, g: jax.Array) -> tuple[jax.Array, ...]:
                return plan.patches(a), plan.kernel_rows(b), plan.gemm_output(g)

        def sums(a: jax.Array, b: jax.Array, g: jax.Array) -> jax.Array:
            if isinstance(recipe, Reference):
                return jnp.zeros((3, _N), jnp.float32)
            ta, tb, tg = operands(a, b, g)
            gkey = None if key is None else jax.random.fold_in(key, 2)
            # each operand counts in the group of its role (K and V of attention: "x")
            rows: dict[str, list] = {"x": [], "w": []}
            rows[kx].append(_stats(recipe, ta, kx, scales[0], None))
            rows[kw].append(_stats(recipe, tb, kw, scales[1], None))
            gs = _stats(recipe, tg, "g", scales[2], gkey)
            return jnp.stack([_merge(rows["x"]), _merge(rows["w"]), gs])

        return qdot, sums


def _summarize(sums: np.ndarray) -> dict[str, dict[str, float]]:
    out = {}
    for i, group in enumerate(GROUPS):
        n, sat, nz, under, sig, noise, neg_min, mx = (float(v) for v in sums[i])
        if n == 0:
            continue
        out[group] = {
            "saturated": sat / n,
            "underflow": under / nz if nz else 0.0,
            "sqnr_db": 10 * math.log10(sig / noise) if noise > 0 and sig > 0 else math.inf,
            "log2_scale_min": -neg_min,
            "log2_scale_max": mx,
        }
    return out


def measures(recipe: Recipe) -> bool:
    """Whether the recipe metrics describe ``recipe``; False, with a warning, for the FP4
    recipes: their GEMMs multiply rotated, re-scaled or stateful operands
    (:meth:`~precisionlab.recipes.FP4Recipe.quantize`), which these statistics, taken against
    the tensor as the model holds it, would misreport."""
    if isinstance(recipe, FP4Recipe):
        warnings.warn(
            f"recipe_metrics are not measured for the FP4 recipe {recipe.name!r} (its GEMMs "
            "multiply rotated, re-scaled or stateful operands); its histograms still are. "
            "`precisionlab verify` and the FP4 tournament's metrics describe FP4 recipes",
            UserWarning,
            stacklevel=3,
        )
        return False
    return True


def make_recipe_metrics_fn(loss_fn: Callable, recipe: TrainRecipe) -> Callable[..., jax.Array]:
    """``fn(params_compute, batch, loss_scale, recipe_state, key) -> sums`` (float32
    ``[3, 8]`` summed over the replaced matmuls; jit it), and turn the sums into the
    per-group dict with :func:`recipe_metrics`."""
    # the recipe's site names: its state is keyed by them
    tapped = intercept(scaled_loss(loss_fn), _MetricsRule(recipe.recipe), include=recipe.include,
                       exclude=recipe.exclude, default=recipe.selects,
                       numbering="primitive")  # fmt: skip

    def fn(pc: Any, batch: Any, ls: Any, recipe_state: Any, key: jax.Array | None) -> jax.Array:
        sites = [s.name for s in tapped.sites(pc, batch, ls) if s.selected]
        grads = probe_grads(tapped, sites, _N, recipe_state, pc, batch, ls, key=key)
        probes = [grads[n] for n in sites]
        if not probes:
            return jnp.zeros((3, _N), jnp.float32)
        stacked = jnp.stack(probes)
        summed = jnp.sum(stacked[..., :6], axis=0)
        return jnp.concatenate([summed, jnp.max(stacked[..., 6:], axis=0)], axis=-1)

    return fn


def recipe_metrics(sums: Any) -> dict[str, dict[str, float]]:
    """``{group: {stat: value}}`` (see :data:`GROUPS`, :data:`STATS`) from the sums."""
    return _summarize(np.asarray(jax.device_get(sums), np.float64))
