"""Gradient statistics per GEMM: how each matmul's three quantized products deviate from the
high-precision ones, measured inside ``jit`` every N steps and recorded by a training hook.

For every matmul (and convolution, as the GEMM over its patches) a recipe replaces, and each
of its three GEMMs (``fprop`` the output, ``dgrad`` the input gradient, ``wgrad`` the weight
gradient), one batch gives the product in high precision ``H`` (the same operands, float32,
HIGHEST) and twice quantized, ``Q1`` and ``Q2``, with independent rounding keys (a second
pass: the recipe's stochastic rounding and random rotations drawn afresh). Per GEMM (sums
over the product's elements):

- ``rel_bias``: the bias of the quantized product relative to ``||H||``, signed:
  ``b2 = ||(Q1+Q2)/2 - H||^2 - ||Q1-Q2||^2 / 4`` estimates ``||E[Q] - H||^2`` without bias
  (the second term removes the variance of the mean of two draws); ``rel_bias =
  sign(b2) sqrt(|b2|) / ||H||`` (can be slightly negative for an unbiased recipe: noise);
- ``rel_var``: ``||Q1-Q2||^2 / 2 / ||H||^2``, the total variance relative to ``||H||^2``
  (0 for a deterministic recipe);
- ``cosine``: cosine similarity of ``Q1`` and ``H``;
- ``ratio``: ``||H|| / sqrt(mean(||Q1-H||^2, ||Q2-H||^2))``, the product's norm over the
  quantization noise (root mean squared error: variance plus squared bias). For ``wgrad``
  this is the gradient-norm to quantization-noise ratio of Chmiel et al. ("FP4 All the Way",
  arXiv 2505.19115, sec. 5): quantized training stops helping once it falls below about
  sqrt(3). Choice: the noise is the RMS error of the weight gradient the recipe produces
  (their sigma), per matmul and over all matmuls (``site="all"``).

The operands are those of a quantized training pass on the batch (the activations and output
gradients the recipe's own forward and backward produce, key ``key``); ``Q1``, ``Q2`` and
``H`` are computed from them inside the backward of an interception rule, and returned as the
cotangent of a per-matmul probe (no side channel), so the whole measurement is one jitted
program. :class:`GemmStatsHook` runs it every ``interval`` steps on the state the step left
and a batch of the run's data, and hands one row per matmul and GEMM to a callback.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab.hardware import ConvGemm
from precisionlab.hardware._gemm import BATCHED_GEMM_DIMS
from precisionlab.intercept import Context, intercept
from precisionlab.mixed._policy import Policy, cast_floating
from precisionlab.recipes import dot_general
from precisionlab.recipes._conv import conv_site
from precisionlab.train._hooks import StepEnd
from precisionlab.train._probes import Dot, Sums, TapRule, probe_grads, scaled_loss
from precisionlab.train._recipe import TrainRecipe
from precisionlab.train._step import weighted_loss

__all__ = ["GEMMS", "SQRT3", "STATS", "GemmStatsHook", "gemm_rows", "make_gemm_stats_fn"]

#: The three GEMMs of a matmul.
GEMMS: tuple[str, ...] = ("fprop", "dgrad", "wgrad")
#: Statistics per GEMM (see the module docstring).
STATS: tuple[str, ...] = ("rel_bias", "rel_var", "cosine", "ratio")
#: Chmiel et al.'s threshold of the gradient-norm to noise ratio.
SQRT3 = math.sqrt(3.0)
# sums per GEMM: ||H||^2, ||Q1-Q2||^2, ||(Q1+Q2)/2-H||^2, <Q1,H>, ||Q1||^2, mean ||Qi-H||^2
_N = 6
_GEMM_KEY = 0x6E57
#: compiled measurements shared by hooks with the same ``cache_key`` (one per process)
_PROGRAMS: dict[Any, tuple[Callable, Callable]] = {}


def _sums(h: jax.Array, q1: jax.Array, q2: jax.Array) -> jax.Array:
    h, q1, q2 = (t.astype(jnp.float32) for t in (h, q1, q2))
    d12 = q1 - q2
    m = (q1 + q2) * 0.5 - h
    e1, e2 = q1 - h, q2 - h
    return jnp.stack(
        [
            jnp.sum(h * h),
            jnp.sum(d12 * d12),
            jnp.sum(m * m),
            jnp.sum(q1 * h),
            jnp.sum(q1 * q1),
            0.5 * (jnp.sum(e1 * e1) + jnp.sum(e2 * e2)),
        ]
    )


@dataclasses.dataclass(frozen=True)
class _StatsRule(TapRule):
    def tap(self, ctx: Context, params: dict, plan: ConvGemm | None) -> tuple[Dot, Sums]:
        recipe, pet = self.recipe, params.get("preferred_element_type")
        # the high-precision product's GEMM: a convolution's over its patches
        dn = BATCHED_GEMM_DIMS if plan is not None else params["dimension_numbers"]
        rstate = ctx.state.get("recipe")
        key = ctx.site_key()

        def qdot(a: jax.Array, b: jax.Array, k: jax.Array | None) -> jax.Array:
            if plan is not None:
                return conv_site(a, b, params, recipe, "rhs", rstate, k)
            return dot_general(a, b, dn, preferred_element_type=pet, recipe=recipe,
                               state=rstate, key=k, weight="rhs")  # fmt: skip

        def hdot(a: jax.Array, b: jax.Array) -> jax.Array:
            a, b = a.astype(jnp.float32), b.astype(jnp.float32)
            if plan is not None:  # a convolution: its GEMM over the patches
                a, b = plan.patches(a), plan.kernel_rows(b)
            y = jax.lax.dot_general(
                a, b, dn, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
            )
            return y if plan is None else plan.output(y)

        def sums(a: jax.Array, b: jax.Array, g: jax.Array) -> jax.Array:
            k1 = None if key is None else jax.random.fold_in(key, 1)
            k2 = None if key is None else jax.random.fold_in(key, 2)
            y1, vjp1 = jax.vjp(lambda a, b: qdot(a, b, k1), a, b)
            y2, vjp2 = jax.vjp(lambda a, b: qdot(a, b, k2), a, b)
            yh, vjph = jax.vjp(hdot, a, b)
            g32 = g.astype(jnp.float32)
            (da1, db1), (da2, db2) = vjp1(g), vjp2(g)
            dah, dbh = vjph(g32)
            return jnp.stack([_sums(yh, y1, y2), _sums(dah, da1, da2), _sums(dbh, db1, db2)])

        return (lambda a, b: qdot(a, b, key)), sums


def make_gemm_stats_fn(
    loss_fn: Callable, recipe: TrainRecipe
) -> tuple[Callable[..., jax.Array], Callable[..., list[str]]]:
    """``(fn, names)``: ``fn(params_compute, batch, loss_scale, recipe_state, key) -> sums``
    (float32 ``[n_matmuls, 3, 6]``, jit it) and ``names(params_compute, batch, loss_scale)``,
    the replaced matmuls' names in the same order; :func:`gemm_rows` turns the sums into rows.
    ``loss_fn(params, batch) -> (loss, aux)`` as the step differentiates it."""
    # the recipe's site names: its state is keyed by them
    tapped = intercept(scaled_loss(loss_fn), _StatsRule(recipe.recipe), include=recipe.include,
                       exclude=recipe.exclude, numbering="primitive")  # fmt: skip

    def names(pc: Any, batch: Any, ls: Any) -> list[str]:
        return [s.name for s in tapped.sites(pc, batch, ls) if s.selected]

    def fn(pc: Any, batch: Any, ls: Any, recipe_state: Any, key: jax.Array | None) -> jax.Array:
        sites = names(pc, batch, ls)
        grads = probe_grads(tapped, sites, _N, recipe_state, pc, batch, ls, key=key)
        if not sites:
            return jnp.zeros((0, 3, _N), jnp.float32)
        return jnp.stack([grads[n] for n in sites])

    return fn, names


def _stats_of(s: np.ndarray) -> dict[str, float | None]:
    hh, d12, m, q1h, q1q1, mse = (float(v) for v in s)
    var = d12 / 2.0
    b2 = m - var / 2.0
    out: dict[str, float | None] = {"norm": math.sqrt(max(hh, 0.0))}
    if hh > 0:
        out["rel_bias"] = math.copysign(math.sqrt(abs(b2) / hh), b2)
        out["rel_var"] = var / hh
        out["cosine"] = q1h / math.sqrt(q1q1 * hh) if q1q1 > 0 else None
        out["ratio"] = math.sqrt(hh / mse) if mse > 0 else math.inf
    else:
        out.update(rel_bias=None, rel_var=None, cosine=None, ratio=None)
    return out


def gemm_rows(sums: Any, names: list[str], step: int) -> list[dict[str, Any]]:
    """One row per matmul and GEMM (``{"step", "site", "gemm", "norm", "rel_bias", "rel_var",
    "cosine", "ratio"}``), then one per GEMM over all matmuls (``site = "all"``: the sums
    added, so ``ratio`` is the whole model's gradient-norm to noise ratio), from the host
    value of ``fn``'s sums."""
    s = np.asarray(jax.device_get(sums), np.float64)
    rows = []
    for i, name in enumerate(names):
        for j, gemm in enumerate(GEMMS):
            rows.append({"step": step, "site": name, "gemm": gemm, **_stats_of(s[i, j])})
    if len(names):
        total = s.sum(axis=0)
        for j, gemm in enumerate(GEMMS):
            rows.append({"step": step, "site": "all", "gemm": gemm, **_stats_of(total[j])})
    return rows


class GemmStatsHook:
    """Measures the gradient statistics every ``interval`` steps (at the steps whose state the
    loop hands to hooks: make ``interval`` a multiple of the loop's chunk, e.g. equal to its
    evaluation interval) and passes the rows to ``record``.

    ``loss_fn`` and ``recipe``: as the step trains them; ``policy``: the run's policy (params
    cast to its compute dtype); ``batch_at(step)``: the batch the measurement uses after
    ``step`` steps (the run's next training batch is a natural choice); the keys are folded
    from the state's PRNG key (a stream the training does not draw from). ``cache_key``: runs
    with equal keys (the same model, recipe and shapes, other seeds) share one compiled
    measurement (its loss function must compute the same: values such as the learning rate
    are read from the state).
    """

    def __init__(
        self,
        loss_fn: Callable,
        recipe: TrainRecipe,
        policy: Policy,
        batch_at: Callable[[int], Any],
        interval: int,
        record: Callable[[list[dict[str, Any]]], None],
        *,
        cache_key: Any = None,
    ) -> None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"interval must be an int >= 1, got {interval!r}")
        self.interval, self.record, self.batch_at = interval, record, batch_at
        self.policy, self.recipe, self.loss_fn = policy, recipe, loss_fn
        self.cache_key = cache_key
        self._fn: Callable | None = None
        self._names: list[str] | None = None

    def _compiled(self, values: Any) -> Callable:
        if self._fn is None:
            made = _PROGRAMS.get(self.cache_key) if self.cache_key is not None else None
            if made is None:
                rec = self.recipe.for_values(values)
                fn, names = make_gemm_stats_fn(weighted_loss(self.loss_fn, values), rec)
                made = (jax.jit(fn), names)
                if self.cache_key is not None:
                    _PROGRAMS[self.cache_key] = made
            self._fn, self._names_fn = made
        return self._fn

    def measure(self, state: Any, step: int) -> list[dict[str, Any]]:
        """The rows for ``state`` (after ``step`` steps) on ``batch_at(step)``."""
        fn = self._compiled(state.values)
        pc = cast_floating(state.params, self.policy.compute_dtype)
        batch = self.batch_at(step)
        if self._names is None:
            self._names = self._names_fn(pc, batch, state.loss_scale)
        key = jax.random.fold_in(state.rng, _GEMM_KEY)
        sums = fn(pc, batch, state.loss_scale, state.recipe_state, key)
        return gemm_rows(sums, self._names, step)

    def on_step(self, end: StepEnd) -> None:
        if end.step % self.interval == 0 and end.state is not None:
            self.record(self.measure(end.state, end.step))

    def close(self) -> None:
        pass
