"""Recording the recipes that own their three GEMMs (:class:`precisionlab.recipes.FP4Recipe`):
every step of their forward and backward (quantizers, rotations, random signs, casts, GEMMs),
as :func:`precisionlab.recipes.fp4_step_tap` reports them, passed out of the program the way
:mod:`precisionlab.verify._tape` passes the other recipes' GEMM records.

A site's forward steps leave as auxiliary output, its backward steps as the cotangent of the
zero tape handed to the site (bit for bit, as 16-bit halves). What each step is (its op, its
static arguments, which arrays are its inputs and outputs) is known at trace time and kept on
the host in a :class:`StepsMeta` per site.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from precisionlab import recipes
from precisionlab.intercept import Context, Emit
from precisionlab.intercept import _boundary as boundary
from precisionlab.verify._tape import FLOATS, RecipeRule, TapedVJP, key_data

__all__ = ["PASSES", "StepsMeta", "StepsRule", "apply_dot3", "pack_steps", "step_pass"]

#: the two passes of a recorded FP4 matmul (its forward; its dgrad and wgrad together)
PASSES = ("fprop", "backward")


@dataclasses.dataclass(eq=False)
class StepsMeta:
    """What the steps of one site's passes are (filled at trace time): per pass a list of
    ``{"op", "static", "inputs": {name: dtype}, "outputs": {name: dtype}, "keys": {name:
    impl}}``."""

    fprop: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    backward: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def _json(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (tuple, list)):
        return [_json(x) for x in v]
    raise ValueError(f"a step's static argument {v!r} is not a JSON value")


def pack_steps(steps: list[recipes.FP4Step]) -> tuple[dict[str, jax.Array], list[dict]]:
    """The steps' arrays as a flat dict (``NNN.op/name``) and their descriptions."""
    arrays: dict[str, jax.Array] = {}
    meta: list[dict[str, Any]] = []
    for i, s in enumerate(steps):
        entry: dict[str, Any] = {"op": s.op, "static": {k: _json(v) for k, v in s.static.items()},
                                 "inputs": {}, "outputs": {}, "keys": {}}  # fmt: skip
        for io in ("inputs", "outputs"):
            for name, v in getattr(s, io).items():
                v = jnp.asarray(v)
                if jnp.issubdtype(v.dtype, jax.dtypes.prng_key):
                    v, impl = key_data(v)
                    entry["keys"][name] = impl
                arrays[f"{i:03d}.{s.op}/{name}"] = v
                entry[io][name] = jnp.dtype(v.dtype).name
        meta.append(entry)
    return arrays, meta


def step_pass(meta: list[dict[str, Any]], which: str) -> list[str]:
    """The GEMM each step feeds: ``fprop``; in the backward, ``dgrad`` up to and including
    its first GEMM, then ``wgrad``."""
    if which == "fprop":
        return ["fprop"] * len(meta)
    out, gemms = [], 0
    for m in meta:
        out.append("dgrad" if gemms == 0 else "wgrad")
        gemms += m["op"] == "gemm"
    return out


def _taped(fn: Callable[..., Any], *args: Any) -> tuple[Any, dict[str, jax.Array], list[dict]]:
    steps: list[recipes.FP4Step] = []
    with recipes.fp4_step_tap(steps.append):
        out = fn(*args)
    arrays, meta = pack_steps(steps)
    return out, arrays, meta


def _ct_state(
    state: dict[str, jax.Array] | None, observed: jax.Array | None
) -> dict[str, jax.Array] | None:
    if state is None:
        return None
    ct = {k: jnp.zeros_like(v) for k, v in state.items()}
    if observed is not None:
        ct["probe"] = observed.astype(state["probe"].dtype)
    return ct


def _tdot3_fwd(
    recipe: recipes.FP4Recipe,
    kinds: tuple[str, str],
    sink: StepsMeta,
    a: jax.Array,
    b: jax.Array,
    state: Any,
    key: jax.Array | None,
    tape: Any,
) -> tuple[tuple[jax.Array, dict[str, jax.Array]], tuple[Any, ...]]:
    (y, res, observed), arrays, meta = _taped(recipe.forward, kinds, a, b, state, key)
    sink.fprop = meta
    return (y, arrays), (res, state, observed, key)


def _tdot3_bwd(
    recipe: recipes.FP4Recipe,
    kinds: tuple[str, str],
    sink: StepsMeta,
    saved: tuple[Any, ...],
    cts: tuple[jax.Array, Any],
) -> tuple[Any, ...]:
    g, _ = cts
    res, state, observed, key = saved
    (da, db), arrays, meta = _taped(recipe.backward, kinds, res, g.astype(jnp.float32), key)
    sink.backward = meta
    return da, db, _ct_state(state, observed), None, arrays


#: a site's forward steps, whose cotangent on ``tape`` is its backward steps
_tdot3 = TapedVJP(_tdot3_fwd, _tdot3_bwd, n_static=3)


@dataclasses.dataclass
class StepsRule(RecipeRule):
    """The recording rule of a recipe owning its GEMMs: its steps, not GEMM records."""

    #: per recorded site: what its steps are
    steps: dict[str, StepsMeta] = dataclasses.field(default_factory=dict)
    # an FP4 recipe's convolution has no step records here: it runs as written, listed in
    # the dump (skipped_sites) and warned about
    primitives: tuple[str, ...] = (boundary.DOT_GENERAL,)
    candidates: tuple[str, ...] = (boundary.CONV, *boundary.RAGGED_PRODUCTS)

    def apply(
        self, ctx: Context, lhs: jax.Array, rhs: jax.Array, **params: Any
    ) -> list[jax.Array] | Emit:
        entry = ctx.state or {}
        rstate = entry.get("recipe") if isinstance(entry, dict) else None
        pet = params.get("preferred_element_type")
        return apply_dot3(self, ctx, lhs, rhs, params["dimension_numbers"], pet, rstate)


def apply_dot3(
    rule: StepsRule,
    ctx: Context,
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    pet: Any,
    rstate: Any,
) -> list[jax.Array] | Emit:
    """:meth:`StepsRule.apply` (``rule``: the rule; its ``steps`` keeps each site's
    :class:`StepsMeta`)."""
    recipe = rule.recipe
    assert isinstance(recipe, recipes.FP4Recipe)  # _record builds a StepsRule for these only
    if str(lhs.dtype) not in FLOATS or str(rhs.dtype) not in FLOATS:
        return [lax.dot_general(lhs, rhs, dimension_numbers, preferred_element_type=pet)]
    state = rstate if recipe.stateful else None
    if ctx.site.name not in rule.recorded:
        out = recipes.dot_general(lhs, rhs, dimension_numbers, preferred_element_type=pet,
                                  recipe=recipe, state=state, key=ctx.site_key(),
                                  weight=rule.weight)  # fmt: skip
        return [out]
    kinds = recipes.WEIGHT_OPERANDS[rule.weight]
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = (tuple(int(d) for d in t) for t in (lc, rc, lb, rb))
    a3, lfree = recipes.canonical_operand(lhs, lc, lb)
    b3, rfree = recipes.canonical_operand(rhs, rc, rb)
    wc, wb = (lc, lb) if kinds == ("w", "x") else (rc, rb)
    sink = rule.steps.setdefault(ctx.site.name, StepsMeta())
    held: dict[str, Any] = {}
    shapes = rule.shapes  # set: a discovery pass (the backward steps' shapes)
    tape = None if shapes is not None else (ctx.state or {})["tape"]

    def run(
        rec: recipes.FP4Recipe,
        kinds: tuple[str, str],
        a: jax.Array,
        b: jax.Array,
        st: Any,
        key: jax.Array | None,
    ) -> jax.Array:
        if shapes is not None:
            shapes[ctx.site.name] = _tdot3.record_shapes(rec, kinds, sink, a, b, st, key, None)
            (y, held["fwd"]), _ = _tdot3_fwd(rec, kinds, sink, a, b, st, key, None)
        else:
            y, held["fwd"] = _tdot3(rec, kinds, sink, a, b, st, key, tape)
        return y

    canon = lambda t: recipes.canonical_operand(t, wc, wb)[0]  # noqa: E731
    out3 = recipe.dot3(kinds, a3, b3, state, ctx.site_key(), canon=canon, run=run)
    out_dtype = pet or jnp.result_type(lhs.dtype, rhs.dtype)
    bshape = tuple(lhs.shape[d] for d in lb)
    out = out3.reshape(*bshape, *lfree, *rfree).astype(out_dtype)
    return Emit([out], held["fwd"])
