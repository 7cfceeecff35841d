"""The train step: one pure function, jitted by the caller.

``step_fn(state, batch)``: cast params to the compute dtype; forward and backward on the scaled
loss (over micro-batches, optionally data parallel); unscale in float32; round gradients to their
storage dtype; finiteness check; optimizer update in float32 with the optimizer state decompressed
from its storage dtype; update applied to the stored params (nearest, stochastic or Kahan); skip on
non-finite gradients (params, optimizer state and update state bitwise untouched); loss-scale
update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from precisionlab.intercept import _boundary as boundary
from precisionlab.mixed._loss_scale import (
    LossScale,
    NoLossScale,
    select_tree,
)
from precisionlab.mixed._policy import Policy, cast_floating
from precisionlab.mixed._storage import (
    Storage,
    StorageState,
    apply_updates,
    init_storage_state,
    store_opt_state,
)
from precisionlab.train._meters import (
    log2_histogram,
    nonfinite_fraction,
    shadow_stats,
    underflow_fraction,
)
from precisionlab.train._parallel import ZeroLayout, data_parallel, local_mesh
from precisionlab.train._predictors import make_predictor_fn
from precisionlab.train._recipe import TrainRecipe
from precisionlab.train._telemetry import make_telemetry_fn

__all__ = [
    "SKIP_MODES",
    "OptimizerFactory",
    "StepOptions",
    "TrainState",
    "TrainStep",
    "build_step",
    "init_recipe_state",
    "normalize_loss_fn",
    "recipe_key",
    "split_micro",
    "weighted_loss",
]

SKIP_MODES: tuple[str, ...] = ("select", "cond")


class TrainState(NamedTuple):
    """Everything a step reads and writes (a pytree; checkpoints store it bitwise).

    step: int32 scalar, steps done (also the data position). params: stored params (storage
    dtype). opt_state: optimizer state (storage dtype). loss_scale: a LossScale. storage_state:
    Kahan compensation or None. rng: uint32[2] PRNG key (stochastic rounding). recipe_state:
    the recipe's state (delayed scaling: ``{matmul name: {"scale", "history", "probe"}}``,
    see :func:`precisionlab.recipes.apply`); ``{}`` for a stateless recipe, None without one.
    values: the run's numeric settings as float32 scalars (``{"lr", "loss_weight", "eps",
    ...}``, see :func:`build_step`), or None: arguments of the compiled step rather than
    constants in it, so runs that differ only in them share one program.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    loss_scale: LossScale
    storage_state: StorageState
    rng: jax.Array
    recipe_state: Any = None
    values: Any = None


#: A function of the state's ``values`` (traced float32 scalars; ``{}`` for a step without
#: values) returning the optimizer.
OptimizerFactory = Callable[[Mapping[str, jax.Array]], optax.GradientTransformation]


def weighted_loss(loss_fn: Callable, values: Mapping[str, Any] | None) -> Callable:
    """``loss_fn`` (normalized to return ``(loss, aux)``) with its loss cast to float32 and
    multiplied by ``values["loss_weight"]``; ``loss_fn`` unchanged without that entry."""
    f = normalize_loss_fn(loss_fn)
    if not values or "loss_weight" not in values:
        return f
    w = values["loss_weight"]

    def weighted(params: Any, batch: Any) -> Any:
        loss, aux = f(params, batch)
        return loss.astype(jnp.float32) * w, aux

    return weighted


def _optimizer(optimizer: Any, values: Mapping[str, Any] | None) -> optax.GradientTransformation:
    """The optimizer itself, or an :data:`OptimizerFactory` called with ``values``."""
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    return optimizer({} if values is None else values)


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


def _zeros_like(s: Any, dtype: Any) -> jax.Array:
    """Zeros of ``s``'s shape in ``dtype``, varying over the manual axes ``s`` varies over."""
    return boundary.pvary(jnp.zeros(s.shape, dtype), boundary.varying_axes(s))


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


def cast_compute(params: Any, dtype: Any, fp32: tuple[str, ...] = ()) -> Any:
    """Floating leaves of ``params`` cast to ``dtype``, those whose ``keystr`` path starts with
    a prefix in ``fp32`` to float32 (layers kept in high precision)."""
    if not fp32:
        return cast_floating(params, dtype)

    def one(path: Any, x: Any) -> Any:
        keep = jax.tree_util.keystr(path).startswith(fp32)
        return cast_floating(x, jnp.float32 if keep else dtype)

    return jax.tree_util.tree_map_with_path(one, params)


def make_grad_fn(
    loss_fn: Callable, policy: Policy, microbatches: int = 1, recipe: TrainRecipe | None = None
) -> Callable:
    """``grad_fn(params_compute, batch, loss_scale, extra) -> (loss, aux, grads, underflow,
    observed)``.

    grads: gradients of the SCALED loss w.r.t. the compute-dtype params, summed over micro-batches
    in float32 (divided by their count), as float32. loss: unscaled float32 mean loss. underflow:
    the meters of the compute-dtype gradients (mean over micro-batches), ``{"underflow": zero or
    subnormal, "nonfinite": inf/NaN}`` fractions of their elements. With a
    ``recipe``, ``extra`` is ``(recipe_state, key)``: every matmul of ``loss_fn`` runs through
    the recipe, and ``observed`` holds the amaxes each matmul saw (delayed scaling; the max over
    micro-batches, see :func:`precisionlab.recipes.combine_observed`); else ``extra`` and
    ``observed`` are ``{}``.
    """
    f = normalize_loss_fn(loss_fn)

    def scaled(p: Any, batch: Any, ls: LossScale) -> tuple[jax.Array, Any]:
        loss, aux = f(p, batch)
        return ls.scale(loss), (loss, aux)

    if recipe is None:

        def value_grad(pc: Any, batch: Any, ls: LossScale, extra: Any) -> tuple[Any, ...]:
            (_, (loss, aux)), g = jax.value_and_grad(scaled, has_aux=True)(pc, batch, ls)
            return loss, aux, g, {}

    else:
        vg = recipe.apply(scaled).value_and_grad(0, has_aux=True)

        def value_grad(pc: Any, batch: Any, ls: LossScale, extra: Any) -> tuple[Any, ...]:
            rstate, key = extra
            (_, (loss, aux)), g, observed = vg(rstate, pc, batch, ls, key=key)
            return loss, aux, g, observed

    def one(pc: Any, batch: Any, ls: LossScale, extra: Any) -> tuple[Any, ...]:
        loss, aux, g, observed = value_grad(pc, batch, ls, extra)
        # zeros/subnormals and inf/NaN apart: a step of NaNs is not an underflow
        meter = {
            "underflow": underflow_fraction(g, policy.compute_dtype, nonfinite=False),
            "nonfinite": nonfinite_fraction(g),
        }
        return loss.astype(jnp.float32), _scalar_aux(aux), g, meter, observed

    if microbatches == 1:

        def grad_fn(pc: Any, batch: Any, ls: LossScale, extra: Any) -> tuple[Any, ...]:
            loss, aux, g, meter, observed = one(pc, batch, ls, extra)
            return loss, aux, cast_floating(g, jnp.float32), meter, observed

        return grad_fn

    def grad_fn(pc: Any, batch: Any, ls: LossScale, extra: Any) -> tuple[Any, ...]:  # type: ignore[no-redef]
        micro = split_micro(batch, microbatches)
        first = jax.tree_util.tree_map(lambda x: x[0], micro)
        # inside a data-parallel shard_map the sums vary over its axis: the zeros that start
        # them must too, or scan refuses carries whose manual axes differ (check_vma on)
        shapes = boundary.eval_shape(lambda b: one(pc, b, ls, extra)[:4], first)
        zero = jax.tree_util.tree_map(lambda s: _zeros_like(s, jnp.float32), shapes)
        obs_shapes = boundary.eval_shape(lambda b: one(pc, b, ls, extra)[4], first)
        # amaxes are >= 0, so 0 is the identity of their max
        obs0 = jax.tree_util.tree_map(lambda s: _zeros_like(s, s.dtype), obs_shapes)

        def body(carry: tuple[Any, Any], b: Any) -> tuple[tuple[Any, Any], None]:
            acc, obs = carry
            out = one(pc, b, ls, extra)
            acc = jax.tree_util.tree_map(lambda a, o: a + o.astype(jnp.float32), acc, out[:4])
            return (acc, jax.tree_util.tree_map(jnp.maximum, obs, out[4])), None

        (acc, observed), _ = jax.lax.scan(body, (zero, obs0), micro)
        inv = jnp.float32(1.0 / microbatches)
        return (*jax.tree_util.tree_map(lambda a: a * inv, acc), observed)

    return grad_fn


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepOptions:
    """How a train step computes, as typed objects (from spec strings:
    :func:`~precisionlab.train._specs.parse_step_options`).

    Attributes:
      policy: the Policy. loss_scale: the initial LossScale (a pytree; its config is static).
      storage: dtypes of stored tensors and the update rounding.
      microbatches: gradient accumulation: the batch's leading axis is split into this many
        micro-batches, processed sequentially (``lax.scan``), gradients averaged in float32.
      seed: seed of the PRNG key in the state (stochastic rounding).
      skip_nonfinite: skip the update when a gradient is non-finite (None: True unless the loss
        scale is a NoLossScale).
      skip: how the skip is written: "cond" (``lax.cond`` around the optimizer update and its
        application, so a skipped step does no update work and the state is updated in place)
        or "select" (compute the update, then select leafwise between new and old state; XLA
        then keeps both trees alive and adds copies: measured slower on CPU, see ``bench
        train``).
      data_parallel: 0 (off), True (all local devices) or a device count; the batch is split
        over a 1-D mesh and gradients all-reduced in ``allreduce_dtype``.
      allreduce_dtype: dtype of the gradient all-reduce (float32 by default).
      zero_stage: ZeRO over the data-parallel devices (needs ``data_parallel``): 0 replicates
        the state, 1 shards the optimizer state, 2 also the gradients (reduce-scatter), 3 also
        the params (see :mod:`precisionlab.train._parallel`; place the state with
        ``parallel.place_state(state, mesh, zero_stage)``).
      report_leaves: add ``finite_leaves`` (bool[n_float_leaves]) to the metrics.
      recipe: a :class:`~precisionlab.train._recipe.TrainRecipe` (or None): every matmul of the
        loss function goes through it (see :func:`build_step`).
      fp32_params: ``jax.tree_util.keystr`` prefixes of params handed to the loss in float32
        rather than the compute dtype (layers kept in high precision: their gradients stay
        float32 too).
      telemetry: a :class:`~precisionlab.train._telemetry.Telemetry` (or None): the step's
        metrics get ``"telemetry"``, statistics of every matmul and state leaf every N steps.
      predictors: a :class:`~precisionlab.train._predictors.Predictors` (or None): the step's
        metrics get ``"predictors"``, the per-layer divergence predictors every N steps.
    """

    policy: Policy = dataclasses.field(default_factory=Policy)
    loss_scale: LossScale = dataclasses.field(default_factory=NoLossScale)
    storage: Storage = dataclasses.field(default_factory=Storage)
    microbatches: int = 1
    seed: int = 0
    skip_nonfinite: bool | None = None
    skip: str = "cond"
    data_parallel: bool | int = False
    allreduce_dtype: np.dtype = dataclasses.field(default_factory=lambda: np.dtype(np.float32))
    report_leaves: bool = False
    recipe: TrainRecipe | None = None
    zero_stage: int = 0
    fp32_params: tuple[str, ...] = ()
    telemetry: Any = None
    predictors: Any = None

    def __post_init__(self) -> None:
        if self.recipe is not None and not isinstance(self.recipe, TrainRecipe):
            raise TypeError(
                f"recipe must be a TrainRecipe, got {type(self.recipe).__name__} "
                "(TrainConfig(recipe=...) takes a recipe name or table)"
            )
        for name, kind in (("policy", Policy), ("loss_scale", LossScale), ("storage", Storage)):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(
                    f"{name} must be a {kind.__name__}, got {type(getattr(self, name)).__name__}"
                    " (precisionlab.train.parse_step_options accepts spec strings)"
                )
        if self.skip not in SKIP_MODES:
            raise ValueError(f"unknown skip mode {self.skip!r}; allowed: {', '.join(SKIP_MODES)}")
        mb = self.microbatches
        if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
            raise ValueError(f"microbatches must be an int >= 1, got {mb!r}")
        object.__setattr__(self, "allreduce_dtype", np.dtype(self.allreduce_dtype))
        if isinstance(self.zero_stage, bool) or self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be one of 0, 1, 2, 3, got {self.zero_stage!r}")
        if self.zero_stage and not self.data_parallel:
            raise ValueError(
                f"zero_stage={self.zero_stage} shards the state over the data-parallel devices: "
                "it needs data_parallel"
            )

    @property
    def skips(self) -> bool:
        """Whether a step with a non-finite gradient is skipped."""
        if self.skip_nonfinite is None:
            return not isinstance(self.loss_scale, NoLossScale)
        return self.skip_nonfinite


class TrainStep(NamedTuple):
    """What :func:`build_step` returns.

    fn: ``fn(state, batch) -> (state, metrics)``, pure and NOT jitted (use
    ``jax.jit(fn, donate_argnums=0)``; ``jax.jit(fn).lower(state, batch).compile()
    .memory_analysis()`` for memory accounting). state: the initial :class:`TrainState`.
    mesh: the 1-D device mesh of a data-parallel step (shard batches with
    ``precisionlab.train._parallel.shard_batch(batch, mesh)``), or None.
    """

    fn: Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]
    state: TrainState
    mesh: Any


def _grad_norm_and_flags(g32: Any) -> tuple[jax.Array, jax.Array, list[jax.Array]]:
    """(global norm, all finite, per-leaf finite flags) of a float32 gradient tree.

    One pass per leaf gives both the norm and the finiteness check: g * 0 is NaN exactly where g
    is inf or NaN and +-0 elsewhere, so the leaf's sum is NaN iff the leaf holds a non-finite
    element, and otherwise equals the sum of squares (which may still overflow to inf for huge
    finite gradients: that is not a skip, as in PyTorch's GradScaler).
    """
    sums = [
        jnp.sum(g * g + g * jnp.zeros((), g.dtype), dtype=jnp.float32)
        for g in jax.tree_util.tree_leaves(g32)
        if jnp.issubdtype(g.dtype, jnp.floating)
    ]
    total = sum(sums) if sums else jnp.zeros((), jnp.float32)
    return jnp.sqrt(total), ~jnp.isnan(total), [~jnp.isnan(x) for x in sums]


def _check_params(params: Any) -> None:
    """TypeError naming the first leaf of ``params`` that is neither an array nor a number (an
    Equinox module's activation function): the train state goes through ``jax.jit``."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if isinstance(leaf, (bool, int, float, complex)) or hasattr(leaf, "dtype"):
            continue
        raise TypeError(
            f"build_step: params must hold arrays; params{jax.tree_util.keystr(path)} is a "
            f"{type(leaf).__name__}. For an Equinox model pass its arrays and close over the "
            "rest: params, static = eqx.partition(model, eqx.is_array) and "
            "loss_fn=lambda p, batch: loss(eqx.combine(p, static), batch)"
        )


def build_step(
    loss_fn: Callable,
    params: Any,
    optimizer: optax.GradientTransformation | OptimizerFactory,
    options: StepOptions | None = None,
    example_batch: Any = None,
    values: Mapping[str, float] | None = None,
) -> TrainStep:
    """Build the train step, its initial state and (data parallel) its mesh.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` or ``(loss, aux)``; receives params already cast
        to the compute dtype; scalar float entries of a dict ``aux`` become metrics.
      params: initial params (any float dtype; stored in the storage dtype).
      optimizer: any optax GradientTransformation; runs in float32.
      options: see :class:`StepOptions` (default: float32, no loss scaling).
      example_batch: a batch (arrays or ShapeDtypeStructs), needed only with a stateful recipe
        (delayed scaling): its state has one entry per matmul, found by tracing ``loss_fn``.
      values: numeric settings kept in ``state.values`` as float32 scalars, so the compiled
        step takes them as arguments (one program for runs that differ only in them):
        ``loss_weight`` multiplies the loss before differentiation (see
        :func:`weighted_loss`), and ``optimizer`` may be an :data:`OptimizerFactory` that
        builds the optimizer from them (``{"lr": ..., "eps": ...}``).

    With ``options.recipe``, ``loss_fn`` runs under :func:`precisionlab.recipes.apply` (on
    the compute-dtype params the policy gives; excluded matmuls stay as the policy computes
    them); NVFP4's stochastic rounding draws from a key folded from the step's key. The
    recipe's state (``state.recipe_state``) is updated after the gradients with the amaxes the
    step observed (max over micro-batches and devices); a step the loss scaler skips leaves it
    unchanged (the observations of an overflowing step are discarded, see
    :func:`precisionlab.recipes.apply`).

    Returns:
      A :class:`TrainStep`. The step's metrics (device arrays): loss, grad_norm, loss_scale (used
      in this step), skipped (bool), underflow_fraction (zero/subnormal), nonfinite_fraction
      (inf/NaN), plus aux scalars (e.g. metric) and,
      with report_leaves, finite_leaves.
    """
    opts = StepOptions() if options is None else options
    if not isinstance(opts, StepOptions):
        raise TypeError(f"options must be a StepOptions, got {type(opts).__name__}")
    _check_params(params)
    state = _initial_state(loss_fn, params, optimizer, opts, example_batch, values)
    layout = _Layout.of(opts, state)
    return TrainStep(_StepFn(loss_fn, optimizer, opts, layout), state, layout.mesh)


def _initial_state(
    loss_fn: Callable,
    params: Any,
    optimizer: optax.GradientTransformation | OptimizerFactory,
    opts: StepOptions,
    example_batch: Any,
    values: Mapping[str, float] | None,
) -> TrainState:
    """The state before the first step (see :func:`build_step`)."""
    pol, store, rec = opts.policy, opts.storage, opts.recipe
    state_values: dict[str, Any] | None = None
    if values is not None:
        state_values = {k: jnp.asarray(v, jnp.float32) for k, v in values.items()}
        if rec is not None and rec.numbers():
            # the recipe's value fields (a margin, an eps, a seed's matrix) as arguments too
            numbers = rec.numbers().items()
            state_values["recipe"] = {k: jnp.asarray(v, jnp.float32) for k, v in numbers}
    loss_init = weighted_loss(loss_fn, values)
    opt = store_opt_state(_optimizer(optimizer, values), store.opt_state_dtype)
    params_stored = cast_floating(params, store.param_dtype(pol.param_dtype))
    recipe_state: dict[str, Any] | None = None if rec is None else {}
    if rec is not None and rec.stateful:
        if example_batch is None:
            raise ValueError(
                f"the {rec.recipe.name} recipe is stateful: build_step needs an example_batch"
            )
        pc = cast_compute(params, pol.compute_dtype, opts.fp32_params)
        recipe_state = init_recipe_state(loss_init, rec, pc, example_batch, opts.loss_scale)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params_stored,
        opt_state=opt.init(cast_floating(params_stored, jnp.float32)),
        loss_scale=opts.loss_scale,
        storage_state=init_storage_state(params_stored, store.update),
        rng=jax.random.PRNGKey(opts.seed),
        recipe_state=recipe_state,
        values=state_values,
    )


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where a data-parallel step runs: its mesh, the gradients' partition specs and, with
    ZeRO, ``zero`` = (shardings of the state, of a params-like tree split over the devices)."""

    mesh: Any = None
    specs: Any = None
    zero: Any = None

    @classmethod
    def of(cls, opts: StepOptions, state: TrainState) -> _Layout:
        if not opts.data_parallel:
            return cls()
        mesh = local_mesh(None if opts.data_parallel is True else int(opts.data_parallel))
        layout = ZeroLayout(mesh, opts.zero_stage)
        zero = None
        if opts.zero_stage:
            zero = (layout.state_shardings(state), layout.split(state.params))
        return cls(mesh, layout.grad_specs(state.params), zero)


class _StepFn:
    """``step_fn(state, batch) -> (state, metrics)`` of :func:`build_step` (see the module
    docstring); ``telemetry_names`` is filled when it is traced."""

    def __init__(
        self, loss_fn: Callable, optimizer: Any, opts: StepOptions, layout: _Layout
    ) -> None:
        self.loss_fn, self.optimizer, self.opts, self.layout = loss_fn, optimizer, opts, layout
        self.telemetry_names: dict[str, Any] = {}

    def grad_fn(self, lf: Callable, rec: TrainRecipe | None) -> Callable:
        opts, mesh = self.opts, self.layout.mesh
        grad_fn = make_grad_fn(lf, opts.policy, opts.microbatches, rec)
        if mesh is not None:
            grad_fn = data_parallel(grad_fn, mesh, opts.allreduce_dtype, self.layout.specs)
        return grad_fn

    def telemetry_fn(self, lf: Callable) -> Callable | None:
        opts = self.opts
        if opts.telemetry is None:
            return None
        fn = make_telemetry_fn(
            lf, opts.policy, opts.telemetry, microbatches=opts.microbatches, mesh=self.layout.mesh
        )
        self.telemetry_names.clear()
        self.telemetry_names.update(fn.names)  # type: ignore[attr-defined]
        return fn

    def update(
        self, opt: Any, params_s: Any, opt_state: Any, storage_state: Any, g32: Any, key: Any
    ) -> tuple[Any, Any, Any]:
        zero = self.layout.zero
        if zero is not None:  # each device updates its slice (ZeRO); elementwise: same values
            params_s, g32 = jax.lax.with_sharding_constraint((params_s, g32), (zero[1], zero[1]))
        p32 = cast_floating(params_s, jnp.float32)
        updates, new_opt = opt.update(g32, opt_state, p32)
        new_params, new_ss = apply_updates(
            params_s, updates, storage_state, update=self.opts.storage.update, key=key
        )
        return new_params, new_opt, new_ss

    def update_or_skip(
        self, opt: Any, old: tuple[Any, Any, Any], g32: Any, key: Any, finite: jax.Array
    ) -> tuple[tuple[Any, Any, Any], jax.Array]:
        """The new (params, opt_state, storage_state) and whether the update was skipped."""
        if not self.opts.skips:
            return self.update(opt, *old, g32, key), jnp.asarray(False)
        if self.opts.skip == "select":
            return select_tree(finite, self.update(opt, *old, g32, key), old), ~finite
        new = jax.lax.cond(finite, lambda: self.update(opt, *old, g32, key), lambda: old)
        return new, ~finite

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        opts, rec = self.opts, self.opts.recipe
        # built here, from the state's (traced) values: they are arguments of the program
        lf = weighted_loss(self.loss_fn, state.values)
        rec_v = None if rec is None else rec.for_values(state.values)
        grad_fn = self.grad_fn(lf, rec_v)
        telemetry_fn = self.telemetry_fn(lf)
        opt = store_opt_state(
            _optimizer(self.optimizer, state.values), opts.storage.opt_state_dtype
        )
        rng, key = jax.random.split(state.rng)
        ls = state.loss_scale
        pc = cast_compute(state.params, opts.policy.compute_dtype, opts.fp32_params)
        extra = {} if rec is None else (state.recipe_state, jax.random.fold_in(key, _RECIPE_KEY))
        loss, aux, g_scaled, meter, observed = grad_fn(pc, batch, ls, extra)
        g32 = _grads_in_storage(ls.unscale(g_scaled), opts.storage.grads_dtype)
        if rec is not None:
            # Telemetry reads g32 (a lax.cond operand): without the barrier, XLA fuses the
            # recipe's wgrad transpose into Adam's moment update in one program and not in
            # the other, and LLVM contracts a different product of that update into an FMA
            # (last bits of nu). Materialised here in both, the update compiles the same.
            g32 = jax.lax.optimization_barrier(g32)
        grad_norm, finite, flags = _grad_norm_and_flags(g32)
        old = (state.params, state.opt_state, state.storage_state)
        new, skipped = self.update_or_skip(opt, old, g32, key, finite)
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm.astype(jnp.float32),
            "loss_scale": ls.loss_scale.astype(jnp.float32),
            "skipped": skipped,
            "underflow_fraction": meter["underflow"],
            "nonfinite_fraction": meter["nonfinite"],
            **aux,
        }
        if opts.report_leaves:
            metrics["finite_leaves"] = jnp.stack(flags) if flags else jnp.ones((0,), bool)
        if telemetry_fn is not None:  # before the update: the state this step's grads came from
            metrics["telemetry"] = telemetry_fn(
                state.params, state.opt_state, ls, g32, batch, state.step
            )
            self.telemetry_names.update(telemetry_fn.names)  # type: ignore[attr-defined]
        if opts.predictors is not None:  # the state this step started from and its update
            predictor_fn = make_predictor_fn(lf, opts.policy, opts.predictors, recipe=rec)
            metrics["predictors"] = predictor_fn(state, new[0], g32, batch, opt)
        recipe_state = state.recipe_state
        if rec_v is not None:
            recipe_state = rec_v.apply(self.loss_fn).update_state(
                state.recipe_state, observed, skip=skipped
            )
        new_state = TrainState(
            step=state.step + 1,
            params=new[0],
            opt_state=new[1],
            loss_scale=ls.adjust(finite),
            storage_state=new[2],
            rng=rng,
            recipe_state=recipe_state,
            values=state.values,
        )
        if self.layout.zero is not None:
            new_state = jax.lax.with_sharding_constraint(new_state, self.layout.zero[0])
        return new_state, metrics


def _grads_in_storage(g32: Any, grads_dtype: np.dtype) -> Any:
    """Float32 gradients rounded through their storage dtype (unchanged for float32)."""
    if grads_dtype != np.dtype(jnp.float32):
        g32 = cast_floating(cast_floating(g32, grads_dtype), jnp.float32)
    return g32


#: Folded into the step's key for the recipe's randomness (NVFP4's stochastic rounding), so a
#: run without a recipe draws exactly as before.
_RECIPE_KEY = 0x5EC


def recipe_key(rng: jax.Array) -> jax.Array:
    """The key the step started from ``rng`` (``TrainState.rng``) gives its recipe, as
    ``step_fn`` derives it (for recorders replaying that step, :mod:`precisionlab.verify`)."""
    return jax.random.fold_in(jax.random.split(rng)[1], _RECIPE_KEY)


def init_recipe_state(
    loss_fn: Callable, recipe: TrainRecipe, params_compute: Any, batch: Any, loss_scale: LossScale
) -> dict[str, Any]:
    """The initial state of ``recipe`` for ``loss_fn`` (``{}`` unless stateful): one entry
    per replaced matmul, named as the train step's trace names them."""
    if not recipe.stateful:
        return {}
    f = normalize_loss_fn(loss_fn)

    # the function the step differentiates (same matmuls)
    def scaled(p: Any, b: Any, ls: LossScale) -> tuple[jax.Array, Any]:
        loss, aux = f(p, b)
        return ls.scale(loss), (loss, aux)

    return recipe.apply(scaled).init_state(params_compute, batch, loss_scale)


def make_probe_fn(
    loss_fn: Callable,
    *,
    policy: Policy,
    shadow_loss_fn: Callable | None = None,
    histograms: bool = True,
) -> Callable[[TrainState, Any], dict[str, Any]]:
    """Diagnostics of one batch at the current state (run every N steps, not every step).

    ``loss_fn`` as for :func:`make_train_step`; a dict aux entry ``"activations"`` (a pytree) is
    histogrammed. Returns ``probe(state, batch) -> dict`` (pure, un-jitted) with, if
    ``histograms``: ``grad_hist`` (log2 histogram of the SCALED compute-dtype gradient, i.e. what
    the compute format must hold) and ``act_hist`` (activations; None without them); if
    ``shadow_loss_fn`` (the same model in float32, called with float32 params): ``shadow_cosine``
    and ``shadow_underflow_lost`` (see :func:`precisionlab.train._meters.shadow_stats`).
    """
    pol = policy

    def probe(state: TrainState, batch: Any) -> dict[str, Any]:
        f = weighted_loss(loss_fn, state.values)  # the loss the step differentiates
        ls = state.loss_scale
        pc = cast_floating(state.params, pol.compute_dtype)

        def scaled(p: Any) -> tuple[jax.Array, Any]:
            loss, aux = f(p, batch)
            return ls.scale(loss), aux

        (_, aux), g = jax.value_and_grad(scaled, has_aux=True)(pc)
        out: dict[str, Any] = {}
        if histograms:
            out["grad_hist"] = log2_histogram(g)
            acts = aux.get("activations") if isinstance(aux, dict) else None
            out["act_hist"] = None if acts is None else log2_histogram(acts)
        if shadow_loss_fn is not None:
            fs = weighted_loss(shadow_loss_fn, state.values)
            p32 = cast_floating(state.params, jnp.float32)
            g_ref = jax.grad(lambda p: fs(p, batch)[0].astype(jnp.float32))(p32)
            g32 = ls.unscale(cast_floating(g, jnp.float32))
            stats = shadow_stats(g32, g_ref, g)
            out["shadow_cosine"] = stats["cosine"]
            out["shadow_underflow_lost"] = stats["underflow_lost"]
        return out

    return probe
