"""The train step: one pure function, jitted by the caller.

``step_fn(state, batch)``: cast params to the compute dtype; forward and backward on the scaled
loss (over micro-batches, optionally data parallel); unscale in float32; round gradients to their
storage dtype; finiteness check; optimizer update in float32 with the optimizer state decompressed
from its storage dtype; update applied to the stored params (nearest, stochastic or Kahan); skip on
non-finite gradients (params, optimizer state and update state bitwise untouched); loss-scale
update.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from precisionlab.mixed.loss_scale import (
    LossScale,
    NoLossScale,
    parse_loss_scale,
    select_tree,
)
from precisionlab.mixed.policy import Policy, cast_floating, get_policy
from precisionlab.mixed.storage import (
    Storage,
    StorageState,
    apply_updates,
    init_storage_state,
    store_opt_state,
)
from precisionlab.train.meters import underflow_fraction

__all__ = ["SKIP_MODES", "TrainState", "make_train_step", "normalize_loss_fn", "split_micro"]

SKIP_MODES: tuple[str, ...] = ("select", "cond")


class TrainState(NamedTuple):
    """Everything a step reads and writes (a pytree; checkpoints store it bitwise).

    step: int32 scalar, steps done (also the data position). params: stored params (storage
    dtype). opt_state: optimizer state (storage dtype). loss_scale: a LossScale. storage_state:
    Kahan compensation or None. rng: uint32[2] PRNG key (stochastic rounding).
    """

    step: jax.Array
    params: Any
    opt_state: Any
    loss_scale: LossScale
    storage_state: StorageState
    rng: jax.Array


def normalize_loss_fn(loss_fn: Callable) -> Callable:
    """``loss_fn`` returning a loss or ``(loss, aux)`` -> function returning ``(loss, aux)``."""

    def wrapped(params: Any, batch: Any) -> tuple[jax.Array, Any]:
        out = loss_fn(params, batch)
        if isinstance(out, tuple):
            if len(out) != 2:
                raise ValueError("loss_fn must return a loss or a (loss, aux) pair")
            return out
        return out, {}

    return wrapped


def split_micro(batch: Any, microbatches: int) -> Any:
    """Reshape every leaf [B, ...] to [microbatches, B // microbatches, ...]."""

    def split(x: jax.Array) -> jax.Array:
        if x.shape[0] % microbatches:
            raise ValueError(
                f"batch size {x.shape[0]} is not divisible by microbatches={microbatches}"
            )
        return x.reshape(microbatches, x.shape[0] // microbatches, *x.shape[1:])

    return jax.tree_util.tree_map(split, batch)


def _scalar_aux(aux: Any) -> dict[str, jax.Array]:
    # Only scalar floating entries of aux become metrics (activations etc. are dropped here).
    if not isinstance(aux, dict):
        return {}
    return {
        k: v.astype(jnp.float32)
        for k, v in aux.items()
        if hasattr(v, "shape") and v.shape == () and jnp.issubdtype(v.dtype, jnp.number)
    }


def make_grad_fn(loss_fn: Callable, policy: Policy, microbatches: int = 1) -> Callable:
    """``grad_fn(params_compute, batch, loss_scale) -> (loss, aux, grads, underflow)``.

    grads: gradients of the SCALED loss w.r.t. the compute-dtype params, summed over micro-batches
    in float32 (divided by their count), as float32. loss: unscaled float32 mean loss. underflow:
    the underflow meter of the compute-dtype gradients (mean over micro-batches).
    """
    f = normalize_loss_fn(loss_fn)

    def one(pc: Any, batch: Any, ls: LossScale):
        def scaled(p):
            loss, aux = f(p, batch)
            return ls.scale(loss), (loss, aux)

        (_, (loss, aux)), g = jax.value_and_grad(scaled, has_aux=True)(pc)
        meter = underflow_fraction(g, policy.compute_dtype)
        return loss.astype(jnp.float32), _scalar_aux(aux), g, meter

    if microbatches == 1:

        def grad_fn(pc, batch, ls):
            loss, aux, g, meter = one(pc, batch, ls)
            return loss, aux, cast_floating(g, jnp.float32), meter

        return grad_fn

    def grad_fn(pc, batch, ls):
        micro = split_micro(batch, microbatches)
        shapes = jax.eval_shape(
            lambda b: one(pc, b, ls), jax.tree_util.tree_map(lambda x: x[0], micro)
        )
        zero = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)

        def body(acc, b):
            out = one(pc, b, ls)
            return jax.tree_util.tree_map(lambda a, o: a + o.astype(jnp.float32), acc, out), None

        acc, _ = jax.lax.scan(body, zero, micro)
        inv = jnp.float32(1.0 / microbatches)
        return jax.tree_util.tree_map(lambda a: a * inv, acc)

    return grad_fn


def make_train_step(
    loss_fn: Callable,
    params: Any,
    optimizer: optax.GradientTransformation,
    *,
    policy: Policy | str = "p=f32,c=f32,o=f32",
    loss_scale: LossScale | str = "none",
    storage: Storage | None = None,
    microbatches: int = 1,
    seed: int = 0,
    skip_nonfinite: bool | None = None,
    skip: str = "cond",
    data_parallel: bool | int = False,
    allreduce_dtype: Any = None,
    report_leaves: bool = False,
) -> tuple[Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]], TrainState]:
    """Build the train step and its initial state.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` or ``(loss, aux)``; receives params already cast
        to the compute dtype; scalar float entries of a dict ``aux`` become metrics.
      params: initial params (any float dtype; stored in the storage dtype).
      optimizer: any optax GradientTransformation; runs in float32.
      policy: a Policy or policy string. loss_scale: a LossScale or spec ("none", "static:S",
        "dynamic"). storage: dtypes of stored tensors and the update rounding (default: params in
        the policy's param dtype, everything else float32, nearest).
      microbatches: gradient accumulation: the batch's leading axis is split into this many
        micro-batches, processed sequentially (``lax.scan``), gradients averaged in float32.
      seed: seed of the PRNG key in the state (stochastic rounding).
      skip_nonfinite: skip the update when a gradient is non-finite (default: True unless
        ``loss_scale`` is "none").
      skip: how the skip is written: "cond" (default: ``lax.cond`` around the optimizer update and
        its application, so a skipped step does no update work and the state is updated in place)
        or "select" (compute the update, then select leafwise between new and old state; XLA then
        keeps both trees alive and adds copies: measured slower on CPU, see ``bench train``).
      data_parallel: False, True (all local devices) or a device count; the batch is split over a
        1-D mesh and gradients all-reduced in ``allreduce_dtype`` (default float32).
      report_leaves: add ``finite_leaves`` (bool[n_float_leaves]) to the metrics.

    Returns:
      ``(step_fn, state)``. ``step_fn(state, batch) -> (state, metrics)`` is pure and NOT jitted
      (use ``jax.jit(step_fn, donate_argnums=0)``). metrics (device arrays): loss, grad_norm,
      loss_scale (used in this step), skipped (bool), underflow_fraction, plus aux scalars (e.g.
      metric) and, with report_leaves, finite_leaves.
    """
    pol = get_policy(policy)
    ls0 = parse_loss_scale(loss_scale)
    store = storage if storage is not None else Storage()
    if not isinstance(store, Storage):
        raise TypeError(f"storage must be a Storage, got {type(store).__name__}")
    if skip not in SKIP_MODES:
        raise ValueError(f"unknown skip mode {skip!r}; allowed: {', '.join(SKIP_MODES)}")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be an int >= 1, got {microbatches!r}")
    do_skip = (not isinstance(ls0, NoLossScale)) if skip_nonfinite is None else skip_nonfinite
    param_dtype = store.param_dtype(pol.param_dtype)
    grads_dtype = np.dtype(store.grads)
    opt = store_opt_state(optimizer, store.opt_state)

    params_stored = cast_floating(params, param_dtype)
    params32 = cast_floating(params_stored, jnp.float32)
    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params_stored,
        opt_state=opt.init(params32),
        loss_scale=ls0,
        storage_state=init_storage_state(params_stored, store.update),
        rng=jax.random.PRNGKey(seed),
    )

    grad_fn = make_grad_fn(loss_fn, pol, microbatches)
    mesh = None
    if data_parallel:
        from precisionlab.train.parallel import data_parallel as dp
        from precisionlab.train.parallel import local_mesh

        mesh = local_mesh(None if data_parallel is True else int(data_parallel))
        red = (
            np.dtype(jnp.float32)
            if allreduce_dtype is None
            else np.dtype(
                get_policy(str(allreduce_dtype)).param_dtype
                if isinstance(allreduce_dtype, str)
                else allreduce_dtype
            )
        )
        grad_fn = dp(grad_fn, mesh, red)

    def update(params_s, opt_state, storage_state, g32, key):
        p32 = cast_floating(params_s, jnp.float32)
        updates, new_opt = opt.update(g32, opt_state, p32)
        new_params, new_ss = apply_updates(
            params_s, updates, storage_state, update=store.update, key=key
        )
        return new_params, new_opt, new_ss

    def step_fn(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        rng, key = jax.random.split(state.rng)
        ls = state.loss_scale
        pc = cast_floating(state.params, pol.compute_dtype)
        loss, aux, g_scaled, meter = grad_fn(pc, batch, ls)
        g32 = ls.unscale(g_scaled)
        if grads_dtype != np.dtype(jnp.float32):
            g32 = cast_floating(cast_floating(g32, grads_dtype), jnp.float32)
        # One pass per leaf gives both the norm and the finiteness check: g * 0 is NaN exactly
        # where g is inf or NaN and +-0 elsewhere, so the leaf's sum is NaN iff the leaf holds a
        # non-finite element, and otherwise equals the sum of squares (which may still overflow to
        # inf for huge finite gradients: that is not a skip, as in PyTorch's GradScaler).
        sums = [
            jnp.sum(g * g + g * jnp.zeros((), g.dtype), dtype=jnp.float32)
            for g in jax.tree_util.tree_leaves(g32)
            if jnp.issubdtype(g.dtype, jnp.floating)
        ]
        total = sum(sums) if sums else jnp.zeros((), jnp.float32)
        flags = [~jnp.isnan(x) for x in sums]
        finite = ~jnp.isnan(total)
        grad_norm = jnp.sqrt(total)
        if not do_skip:
            new_p, new_o, new_s = update(
                state.params, state.opt_state, state.storage_state, g32, key
            )
            skipped = jnp.asarray(False)
        elif skip == "select":
            new_p, new_o, new_s = update(
                state.params, state.opt_state, state.storage_state, g32, key
            )
            new_p, new_o, new_s = select_tree(
                finite, (new_p, new_o, new_s), (state.params, state.opt_state, state.storage_state)
            )
            skipped = ~finite
        else:
            new_p, new_o, new_s = jax.lax.cond(
                finite,
                lambda: update(state.params, state.opt_state, state.storage_state, g32, key),
                lambda: (state.params, state.opt_state, state.storage_state),
            )
            skipped = ~finite
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm.astype(jnp.float32),
            "loss_scale": ls.loss_scale.astype(jnp.float32),
            "skipped": skipped,
            "underflow_fraction": meter,
            **aux,
        }
        if report_leaves:
            metrics["finite_leaves"] = jnp.stack(flags) if flags else jnp.ones((0,), bool)
        new_state = TrainState(
            step=state.step + 1,
            params=new_p,
            opt_state=new_o,
            loss_scale=ls.adjust(finite),
            storage_state=new_s,
            rng=rng,
        )
        return new_state, metrics

    step_fn.mesh = mesh  # type: ignore[attr-defined]
    step_fn.policy = pol  # type: ignore[attr-defined]
    return step_fn, state


def make_probe_fn(
    loss_fn: Callable,
    *,
    policy: Policy | str,
    shadow_loss_fn: Callable | None = None,
    histograms: bool = True,
) -> Callable[[TrainState, Any], dict[str, Any]]:
    """Diagnostics of one batch at the current state (run every N steps, not every step).

    ``loss_fn`` as for :func:`make_train_step`; a dict aux entry ``"activations"`` (a pytree) is
    histogrammed. Returns ``probe(state, batch) -> dict`` (pure, un-jitted) with, if
    ``histograms``: ``grad_hist`` (log2 histogram of the SCALED compute-dtype gradient, i.e. what
    the compute format must hold) and ``act_hist`` (activations; None without them); if
    ``shadow_loss_fn`` (the same model in float32, called with float32 params): ``shadow_cosine``
    and ``shadow_underflow_lost`` (see :func:`precisionlab.train.meters.shadow_stats`).
    """
    from precisionlab.train.meters import log2_histogram, shadow_stats

    pol = get_policy(policy)
    f = normalize_loss_fn(loss_fn)

    def probe(state: TrainState, batch: Any) -> dict[str, Any]:
        ls = state.loss_scale
        pc = cast_floating(state.params, pol.compute_dtype)

        def scaled(p):
            loss, aux = f(p, batch)
            return ls.scale(loss), aux

        (_, aux), g = jax.value_and_grad(scaled, has_aux=True)(pc)
        out: dict[str, Any] = {}
        if histograms:
            out["grad_hist"] = log2_histogram(g)
            acts = aux.get("activations") if isinstance(aux, dict) else None
            out["act_hist"] = None if acts is None else log2_histogram(acts)
        if shadow_loss_fn is not None:
            fs = normalize_loss_fn(shadow_loss_fn)
            p32 = cast_floating(state.params, jnp.float32)
            g_ref = jax.grad(lambda p: fs(p, batch)[0].astype(jnp.float32))(p32)
            g32 = ls.unscale(cast_floating(g, jnp.float32))
            stats = shadow_stats(g32, g_ref, g)
            out["shadow_cosine"] = stats["cosine"]
            out["shadow_underflow_lost"] = stats["underflow_lost"]
        return out

    return probe
