"""Apply a recipe to any JAX function: every matched ``dot_general`` becomes quantized.

State (delayed scaling) is a plain dict ``{site name: {"scale", "history", "probe"}}`` of
float32 arrays (a pytree: checkpoint it, shard it, thread it through ``jit``). The
observed amaxes of a step come back as the gradient of the ``"probe"`` leaves (the backward
GEMM's output-gradient amax is only known there; a ``scan`` over layers combines its
iterations with max, not sum). :meth:`Applied.value_and_grad` returns them separately, and
:meth:`Applied.update_state` rolls them into the history and recomputes the scales:

- micro-batches: combine the observations of k micro-batches with :func:`combine_observed`
  (elementwise max) and update once: the same history and scales as one full batch;
- data parallelism: ``lax.pmax`` the observations over the data axis before updating;
- a step the loss scaler skips: pass ``skip=True`` (a traced bool is fine) and the state is
  returned unchanged. Convention: the observations of an overflowing step are discarded,
  because a non-finite amax in a "max" history would freeze the scale for
  ``amax_history_len`` steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from precisionlab.intercept import Context, Intercepted, Site, boundary, intercept
from precisionlab.mixed import filter_value_and_grad
from precisionlab.recipes._dot import WEIGHT_OPERANDS, _named, dot_general
from precisionlab.recipes._recipes import Delayed, Recipe

__all__ = [
    "Applied",
    "apply",
    "combine_observed",
    "einsum",
    "init_site_state",
    "update_site_state",
]

_FLOATS = ("float16", "bfloat16", "float32", "float64")


def init_site_state(recipe: Delayed) -> dict[str, jax.Array]:
    """One matmul's delayed-scaling state: scales 1, an all-zero history (L, 3), a probe.
    Index 0, 1, 2 of the last axis: lhs, rhs, output gradient."""
    return {
        "scale": jnp.ones((3,), jnp.float32),
        "history": jnp.zeros((recipe.amax_history_len, 3), jnp.float32),
        "probe": jnp.zeros((3,), jnp.float32),
    }


def _kind_max(recipe: Delayed, weight: str) -> jax.Array:
    kinds = (*WEIGHT_OPERANDS[weight], "g")
    return jnp.asarray([recipe.fmt(k).max for k in kinds], jnp.float32)


def update_site_state(
    recipe: Delayed, state: dict, observed: jax.Array, weight: str = "rhs"
) -> dict[str, jax.Array]:
    """Roll the observed amaxes (3,) into the history (row 0 newest) and recompute the scales
    by the recipe's rule."""
    hist = jnp.concatenate([observed[None].astype(jnp.float32), state["history"][:-1]])
    scale = recipe.next_scale(hist, state["scale"], _kind_max(recipe, weight))
    return {"scale": scale, "history": hist, "probe": state["probe"]}


def combine_observed(a: dict, b: dict) -> dict:
    """Elementwise max of two observation dicts (micro-batches of one step)."""
    return jax.tree.map(jnp.maximum, a, b)


@dataclasses.dataclass(frozen=True)
class _DotRule:
    recipe: Recipe
    weight: str
    primitives: tuple[str, ...] = ("dot_general",)
    emits = False  # never an Emit: a stateless call without a key is rewritten by type

    def apply(self, ctx: Context, lhs, rhs, *, dimension_numbers, **params) -> list:
        pet = params.get("preferred_element_type")
        if str(lhs.dtype) not in _FLOATS or str(rhs.dtype) not in _FLOATS:
            # an integer matmul (indices, masks) is left as it was
            return [jax.lax.dot_general(lhs, rhs, dimension_numbers, preferred_element_type=pet)]
        out = dot_general(
            lhs, rhs, dimension_numbers, preferred_element_type=pet, recipe=self.recipe,
            state=ctx.state, key=ctx.site_key(), weight=self.weight,
        )  # fmt: skip
        return [out]


class Applied:
    """A function with a recipe applied; see :func:`apply`."""

    def __init__(self, fn, recipe: Recipe, include, exclude, weight: str):
        if weight not in WEIGHT_OPERANDS:
            raise ValueError(f"unknown weight {weight!r}; allowed: {', '.join(WEIGHT_OPERANDS)}")
        model = getattr(fn, "matmul_model", None)  # emulate(...)'s hardware= name
        if isinstance(model, str) and model != "float32":
            raise ValueError(
                f"recipes.apply over emulate(..., hardware={model!r}): that tensor-core model "
                "leaves no dot_general for the recipe to quantize; pass hardware='float32' to "
                "emulate and the hardware preset to the recipe (accumulate=...)"
            )
        self.recipe, self.weight = recipe, weight
        # inspect.signature reads fn's: nnx.value_and_grad and nnx.jit bind arguments by it
        self.__wrapped__ = fn
        self.intercepted: Intercepted = intercept(
            fn, _DotRule(recipe, weight), include=include, exclude=exclude
        )

    def sites(self, *args, **kwargs) -> list[Site]:
        """The matched matmuls (see :class:`precisionlab.intercept.Site`)."""
        return self.intercepted.sites(*args, **kwargs)

    def report(self, *args, **kwargs) -> str:
        """One line per matched matmul, saying which the recipe replaces."""
        return self.intercepted.report(*args, **kwargs)

    def init_state(self, *args, **kwargs) -> dict[str, Any]:
        """Fresh state for these arguments: ``{}`` unless the recipe is stateful (delayed),
        then one :func:`init_site_state` per replaced matmul."""
        if not self.recipe.stateful:
            return {}
        return {
            s.name: init_site_state(self.recipe) for s in self.sites(*args, **kwargs) if s.selected
        }

    def _check_state(self, state):
        if self.recipe.stateful and state is None:
            raise ValueError(
                f"the {self.recipe.name} recipe is stateful: pass state=f.init_state(*args), "
                "f being this recipes.apply(...) result"
            )

    def __call__(self, *args, state: dict | None = None, key=None, **kwargs) -> Any:
        """``fn(*args, **kwargs)`` with the recipe (forward; the state is only read)."""
        self._check_state(state)
        return self.intercepted.call_with_state(state, *args, key=key, **kwargs)

    def value_and_grad(
        self, argnums: int | Sequence[int] = 0, has_aux: bool = False
    ) -> Callable[..., tuple[Any, Any, dict]]:
        """``f(state, *args, key=None, **kwargs) -> (value, grads, observed)``: like
        ``jax.value_and_grad(fn, argnums, has_aux)`` plus the observed amaxes per site
        (``{}`` for stateless recipes), to pass to :meth:`update_state`.

        The differentiated arguments may hold non-array leaves (an Equinox module's activation
        function): only floating arrays are differentiated, the others pass through with
        gradient None (:func:`precisionlab.mixed.filter_value_and_grad`). Inside a user's
        ``shard_map`` the observed amaxes are each device's (``lax.pmax`` them before
        :meth:`update_state`); the gradients are JAX's (a replicated argument's summed)."""
        nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

        def f(state, *args, key=None, **kwargs):
            self._check_state(state)
            state = state or {}
            # inside shard_map: the state varies as the data does, so each device observes
            # its own amaxes (a replicated state's cotangent would be their sum)
            state = boundary.match_varying(state, boundary.tree_varying_axes((args, kwargs)))

            def run(st, *a):
                return self.intercepted.call_with_state(st, *a, key=key, **kwargs)

            # filtered: an Equinox model's non-array leaves pass through (gradient None)
            vg = filter_value_and_grad(run, argnums=(0, *(n + 1 for n in nums)), has_aux=has_aux)
            value, grads = vg(state, *args)
            observed = {k: v["probe"] for k, v in grads[0].items()}
            g = grads[1] if isinstance(argnums, int) else tuple(grads[1:])
            return value, g, observed

        return f

    def update_state(self, state: dict, observed: dict, *, skip: Any = False) -> dict:
        """The state after a step that observed ``observed``; unchanged where ``skip``."""
        if not self.recipe.stateful:
            return state
        new = {
            k: update_site_state(self.recipe, v, observed[k], self.weight) for k, v in state.items()
        }
        return jax.tree.map(lambda old, n: jnp.where(skip, old, n), state, new)


def apply(
    fn: Callable,
    recipe: Recipe | str,
    *,
    include: Sequence[int | str] | int | str | None = None,
    exclude: Sequence[int | str] | int | str = (),
    weight: str = "rhs",
) -> Applied:
    """``fn`` with every ``dot_general`` (matmul, einsum, dense layer, attention product)
    quantized by ``recipe``.

    Args:
      fn: any JAX function: a Flax ``model.apply``, an Equinox model call, a plain pytree
        model, a loss. Traced with the interception layer (:mod:`precisionlab.intercept`).
      recipe: a :class:`Recipe` or a name (``"mxfp8"``, ``"delayed"``, ...). A named block
        recipe pads contractions that are not a multiple of its block with zeros (as training
        does; zeros change neither a block's amax nor the products); pass a Recipe object
        (``get_recipe("mxfp8", pad=False)``) to refuse such sizes instead.
      include / exclude: which matched matmuls to quantize, by position (``-1``: the last),
        name (``"dot_general[3]"``) or glob pattern on the name or the ``named_scope`` /
        ``jit`` scope; ``exclude=(0, -1)`` keeps the first and last in high precision.
      weight: which operand of each matmul is the weight: ``"rhs"`` (``x @ w``; default),
        ``"lhs"`` (Equinox's ``w @ x``) or ``"none"``.

    Returns:
      An :class:`Applied`: call it like ``fn`` (``state=`` for delayed scaling, ``key=`` for
      NVFP4's stochastic rounding); ``.report(...)`` lists the matmuls;
      ``.value_and_grad(...)`` and ``.update_state(...)`` train with stateful recipes.
    """
    return Applied(fn, _named(recipe), include, exclude, weight)


def einsum(spec: str, a: jax.Array, b: jax.Array, *, recipe: Recipe | str, **kwargs) -> jax.Array:
    """Two-operand ``jnp.einsum`` whose contraction runs through :func:`dot_general`
    (traced with ``jnp.einsum`` and its single ``dot_general`` replaced)."""
    return apply(lambda x, y: jnp.einsum(spec, x, y), recipe, **kwargs)(a, b)
