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
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp

from precisionlab.intercept import Context, Intercepted, Site, compute_line, intercept
from precisionlab.intercept import _boundary as boundary
from precisionlab.mixed import filter_value_and_grad
from precisionlab.recipes._conv import NOT_COVERED, conv_site
from precisionlab.recipes._dot import WEIGHT_OPERANDS, Weight, as_recipe, dot_general
from precisionlab.recipes._fp4 import FP4Recipe
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
#: Which matched operations to quantize (``include`` / ``exclude`` of :func:`apply`).
Selection: TypeAlias = Sequence[int | str | re.Pattern] | int | str


def init_site_state(recipe: Delayed) -> dict[str, jax.Array]:
    """One matmul's delayed-scaling state: scales 1, an all-zero history (L, 3), a probe.
    Index 0, 1, 2 of the last axis: lhs, rhs, output gradient."""
    return {
        "scale": jnp.ones((3,), jnp.float32),
        "history": jnp.zeros((recipe.amax_history_len, 3), jnp.float32),
        "probe": jnp.zeros((3,), jnp.float32),
    }


def _kind_max(recipe: Delayed, weight: str) -> jax.Array:
    kinds = (*WEIGHT_OPERANDS.get(weight, WEIGHT_OPERANDS["rhs"]), "g")
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
    primitives: tuple[str, ...] = boundary.PRODUCTS
    candidates: tuple[str, ...] = NOT_COVERED
    emits = False  # never an Emit: a stateless call without a key is rewritten by type

    @property
    def label(self) -> str:
        return f"recipe {self.recipe.name!r}"

    def declines(self, site: Site) -> str | None:
        """Integer (and 8-bit) matmuls and convolutions are left as they were."""
        bad = [d for d in site.in_dtypes if d not in _FLOATS]
        if bad:
            return f"{' x '.join(site.in_dtypes)} operands (recipes take {', '.join(_FLOATS)})"
        return None

    def apply(self, ctx: Context, lhs: jax.Array, rhs: jax.Array, **params: Any) -> list[jax.Array]:
        if ctx.site.skipped:
            return ctx.original(lhs, rhs)
        weight: Weight = self.weight
        if weight == "auto":  # each operand's role from the dataflow (K and V: activations)
            weight = ctx.site.roles or "rhs"
        if ctx.site.primitive == boundary.CONV:
            return [conv_site(lhs, rhs, params, self.recipe, weight, ctx.state, ctx.site_key())]
        dimension_numbers = params["dimension_numbers"]
        pet = params.get("preferred_element_type")
        if str(lhs.dtype) not in _FLOATS or str(rhs.dtype) not in _FLOATS:
            # an integer matmul (indices, masks) is left as it was
            return [jax.lax.dot_general(lhs, rhs, dimension_numbers, preferred_element_type=pet)]
        out = dot_general(
            lhs, rhs, dimension_numbers, preferred_element_type=pet, recipe=self.recipe,
            state=ctx.state, key=ctx.site_key(), weight=weight,
        )  # fmt: skip
        return [out]


WEIGHTS = ("auto", *WEIGHT_OPERANDS)


def weight_products(site: Site) -> bool:
    """The default selection of a recipe: every operation but the products of two
    activations (attention's ``QK^T`` and ``PV``), as Transformer Engine quantizes."""
    return not site.activations_only


class Applied:
    """A function with a recipe applied; see :func:`apply`."""

    def __init__(
        self, fn: Callable[..., Any], recipe: Recipe, include: Selection | None,
        exclude: Selection, weight: str, attention: bool = False,
        params: int | Sequence[int] | None = None,
    ) -> None:  # fmt: skip
        if weight not in WEIGHTS:
            raise ValueError(f"unknown weight {weight!r}; allowed: {', '.join(WEIGHTS)}")
        if not isinstance(attention, bool):
            raise TypeError(f"attention must be True or False, got {attention!r}")
        model = getattr(fn, "matmul_model", None)  # emulate(...)'s hardware= name
        if isinstance(model, str) and model != "float32":
            raise ValueError(
                f"recipes.apply over emulate(..., hardware={model!r}): that tensor-core model "
                "leaves no dot_general for the recipe to quantize; pass hardware='float32' to "
                "emulate and the hardware preset to the recipe (accumulate=...)"
            )
        self.recipe, self.weight, self.attention = recipe, weight, attention
        # inspect.signature reads fn's: nnx.value_and_grad and nnx.jit bind arguments by it
        self.__wrapped__ = fn
        self.intercepted: Intercepted = intercept(
            fn, _DotRule(recipe, weight), include=include, exclude=exclude,
            numbering="primitive", params=params, default=None if attention else weight_products,
        )  # fmt: skip

    def sites(self, *args: Any, **kwargs: Any) -> list[Site]:
        """The matched matmuls (see :class:`precisionlab.intercept.Site`)."""
        return self.intercepted.sites(*args, **kwargs)

    def report(self, *args: Any, **kwargs: Any) -> str:
        """One line per matched matmul and convolution (the parameter it multiplies, whether
        the recipe replaces it), the operations left as they were, and the compute-dtype line
        (:func:`precisionlab.intercept.compute_line`: the dtypes the products multiply in
        before the recipe quantizes them)."""
        text = self.intercepted.report(*args, **kwargs)
        return f"{text}\n{compute_line(self.sites(*args, **kwargs))}"

    def init_state(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Fresh state for these arguments: ``{}`` unless the recipe is stateful (delayed),
        then one :func:`init_site_state` per replaced matmul."""
        if not self.recipe.stateful:
            return {}
        return {s.name: self._site_state(s) for s in self.sites(*args, **kwargs) if s.selected}

    def _site_state(self, site: Site) -> dict[str, jax.Array]:
        rec = self.recipe
        if isinstance(rec, FP4Recipe):  # per-site shapes: the weight operand's
            return rec.site_state(site, self._site_weight(site))
        return init_site_state(_delayed(rec))

    def _site_weight(self, site: Site) -> str:
        """The name of :data:`WEIGHT_OPERANDS` saying which operand of ``site`` is the weight
        (``"auto"``: from the site's roles, as the rule reads them; ``"rhs"`` without roles)."""
        if self.weight != "auto":
            return self.weight
        names: dict[tuple[str, ...], str] = {k: n for n, k in WEIGHT_OPERANDS.items()}
        return names.get(site.roles, "rhs")

    def _check_state(self, state: dict | None) -> None:
        if self.recipe.stateful and state is None:
            raise ValueError(
                f"the {self.recipe.name} recipe is stateful: pass state=f.init_state(*args), "
                "f being this recipes.apply(...) result"
            )

    def __call__(
        self, *args: Any, state: dict | None = None, key: jax.Array | None = None, **kwargs: Any
    ) -> Any:
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

        def f(
            state: dict | None, *args: Any, key: jax.Array | None = None, **kwargs: Any
        ) -> tuple[Any, Any, dict]:
            self._check_state(state)
            state = state or {}
            # inside shard_map: the state varies as the data does, so each device observes
            # its own amaxes (a replicated state's cotangent would be their sum)
            state = boundary.match_varying(state, boundary.tree_varying_axes((args, kwargs)))

            def run(st: dict, *a: Any) -> Any:
                return self.intercepted.call_with_state(st, *a, key=key, **kwargs)

            # filtered: an Equinox model's non-array leaves pass through (gradient None)
            vg = filter_value_and_grad(run, argnums=(0, *(n + 1 for n in nums)), has_aux=has_aux)
            value, grads = vg(state, *args)
            observed = {k: v["probe"] for k, v in grads[0].items() if "probe" in v}
            g = grads[1] if isinstance(argnums, int) else tuple(grads[1:])
            return value, g, observed

        return f

    def update_state(self, state: dict, observed: dict, *, skip: Any = False) -> dict:
        """The state after a step that observed ``observed``; unchanged where ``skip``."""
        if not self.recipe.stateful:
            return state
        rec = self.recipe
        if isinstance(rec, FP4Recipe):
            new = {k: rec.update_site(v, observed.get(k)) for k, v in state.items()}
        else:
            dl = _delayed(rec)
            new = {k: update_site_state(dl, v, observed[k], self.weight) for k, v in state.items()}
        return jax.tree.map(lambda old, n: jnp.where(skip, old, n), state, new)


def _delayed(recipe: Recipe) -> Delayed:
    """The stateful recipe whose state :func:`init_site_state` makes (the FP4 recipes make
    their own)."""
    if not isinstance(recipe, Delayed):
        raise TypeError(
            f"the {recipe.name} recipe is stateful but neither Delayed nor an FP4 recipe (with "
            "site_state and update_site): recipes.apply keeps no state for it"
        )
    return recipe


def apply(
    fn: Callable[..., Any],
    recipe: Recipe | str,
    *,
    include: Selection | None = None,
    exclude: Selection = (),
    weight: str = "auto",
    attention: bool = False,
    params: int | Sequence[int] | None = None,
) -> Applied:
    """``fn`` with every matmul (``dot_general``: matmul, einsum, dense layer) and convolution
    (``conv_general_dilated``) quantized by ``recipe``; products of two activations
    (attention's ``QK^T`` and ``PV``) only with ``attention=True`` or an ``include`` naming them.

    Args:
      fn: any JAX function: a Flax ``model.apply``, an Equinox model call, a plain pytree
        model, a loss. Traced with the interception layer (:mod:`precisionlab.intercept`).
      recipe: a :class:`Recipe` or a name (``"mxfp8"``, ``"delayed"``, ...). A named block
        recipe pads contractions that are not a multiple of its block with zeros (as training
        does; zeros change neither a block's amax nor the products); pass a Recipe object
        (``get_recipe("mxfp8", pad=False)``) to refuse such sizes instead.
      include / exclude: which matched operations to quantize: positions in program order
        (``-1``: the last), names (``"dot_general[3]"``, ``"conv_general_dilated[0]"``), or
        glob patterns and regular expressions (``re.compile(...)`` or ``"re:..."``, matched
        whole) on the parameter each multiplies (``"layers/*/mlp/kernel"``: the input
        leaf's pytree path), its module path (``"layers/0/attn/q_proj"``), the name or the
        ``named_scope`` / ``jit`` scope; ``exclude=(0, -1)`` keeps the first and last in
        high precision. An item matching nothing is a ValueError listing what exists.
      weight: which operand of each product is the weight: ``"auto"`` (default: each
        operand's role from the dataflow; a weight depends on parameters only, so K and V
        are activations), or for every site ``"rhs"`` (``x @ w``), ``"lhs"`` (``w @ x``),
        ``"none"`` or ``"both"``.
      attention: quantize the products of two activations too (Transformer Engine leaves
        them in high precision; so does the default).
      params: the positions of the arguments holding the parameters (default: the first
        argument of a call with two or more, as in ``apply(params, x)``; see
        :func:`precisionlab.intercept.intercept`). Captured constants count as parameters.

    Returns:
      An :class:`Applied`: call it like ``fn`` (``state=`` for delayed scaling, ``key=`` for
      NVFP4's stochastic rounding); ``.report(...)`` lists the operations, the parameter
      each multiplies and which are quantized; ``.value_and_grad(...)`` and
      ``.update_state(...)`` train with stateful recipes.
    """
    return Applied(fn, as_recipe(recipe), include, exclude, weight, attention, params)


def einsum(
    spec: str, a: jax.Array, b: jax.Array, *, recipe: Recipe | str, **kwargs: Any
) -> jax.Array:
    """Two-operand ``jnp.einsum`` whose contraction runs through :func:`dot_general`
    (traced with ``jnp.einsum`` and its single ``dot_general`` replaced; ``b`` is the weight
    unless ``weight=`` says otherwise)."""
    kwargs = {"weight": "rhs", "attention": True, **kwargs}
    return apply(lambda x, y: jnp.einsum(spec, x, y), recipe, **kwargs)(a, b)
