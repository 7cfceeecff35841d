"""The training loop: jitted steps, metrics, evaluation, divergence detection, hooks.

:func:`train` runs a :class:`~precisionlab.train.config.TrainConfig`: :func:`build` turns it into
typed pieces (model, data, optimizer, schedule, :class:`~precisionlab.train.step.StepOptions`,
:class:`LoopOptions`) and :func:`train_loop` runs any ``loss_fn`` over any batch source. What
happens around a step (progress bar, checkpoints, the caller's callback) is a list of
:class:`Hook` objects; the run's totals are an :class:`Aggregates` value updated by a pure
function.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax

from precisionlab._io import from_json_float
from precisionlab.mixed.loss_scale import nonfinite_leaf_names
from precisionlab.mixed.policy import Policy, cast_floating, get_policy
from precisionlab.train.checkpoint import save_checkpoint
from precisionlab.train.config import (
    DIVERGENCE_ACTIONS,
    TrainConfig,
    TrainResult,
    check_loss_weight,
)
from precisionlab.train.data import Dataset, make_data
from precisionlab.train.distributed import is_main, restore_checkpoint
from precisionlab.train.meters import hist_edges
from precisionlab.train.models import Model, make_model
from precisionlab.train.optim import make_optimizer, make_schedule
from precisionlab.train.step import (
    StepOptions,
    TrainState,
    build_step,
    make_probe_fn,
    normalize_loss_fn,
)
from precisionlab.train.telemetry import parse_telemetry, telemetry_rows

__all__ = [
    "Aggregates",
    "CallbackHook",
    "CheckpointHook",
    "Hook",
    "LoopOptions",
    "ProgressHook",
    "StepEnd",
    "TrainSetup",
    "build",
    "evaluate",
    "make_eval_fn",
    "train",
    "train_loop",
]


# --- options and totals ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopOptions:
    """How the loop runs around the step (see :func:`train_loop`)."""

    steps: int
    eval_interval: int = 0
    checkpoint_interval: int = 0
    divergence_k: float | None = None
    divergence_action: str = "stop"
    hist_interval: int = 0
    shadow_interval: int = 0
    loss_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.divergence_action not in DIVERGENCE_ACTIONS:
            raise ValueError(
                f"unknown divergence_action {self.divergence_action!r}; allowed: "
                f"{', '.join(DIVERGENCE_ACTIONS)}"
            )
        check_loss_weight(self.loss_weight)


@dataclasses.dataclass(frozen=True)
class Aggregates:
    """Totals of a run so far (checkpointed with the state, so a resumed run continues them).

    ``final_loss`` is the last step's loss (nan/inf after a divergence); ``running_min`` the least
    finite loss (for ``divergence_k``); ``underflow_sum`` the sum of the underflow meter.
    """

    diverged: bool = False
    divergence_step: int | None = None
    running_min: float = math.inf
    skipped_steps: int = 0
    min_loss_scale: float = math.inf
    max_loss_scale: float = -math.inf
    underflow_sum: float = 0.0
    final_loss: float = math.nan
    evals: tuple[dict[str, Any], ...] = ()
    recipe_metrics: dict[str, dict[str, float]] | None = None
    recipe_probes: int = 0

    def update(self, step: int, rec: dict[str, Any], divergence_k: float | None) -> Aggregates:
        """The totals after step ``step`` (1-based) recorded as ``rec``. Pure."""
        loss = rec["loss"]
        bad = not math.isfinite(loss) or (
            divergence_k is not None
            and math.isfinite(self.running_min)
            and loss > divergence_k * self.running_min
        )
        newly = bad and not self.diverged
        return dataclasses.replace(
            self,
            diverged=self.diverged or bad,
            divergence_step=step if newly else self.divergence_step,
            running_min=min(self.running_min, loss) if math.isfinite(loss) else self.running_min,
            skipped_steps=self.skipped_steps + int(rec["skipped"]),
            min_loss_scale=min(self.min_loss_scale, rec["loss_scale"]),
            max_loss_scale=max(self.max_loss_scale, rec["loss_scale"]),
            underflow_sum=self.underflow_sum + rec["underflow_fraction"],
            final_loss=loss,
        )

    def with_recipe_metrics(self, m: dict[str, dict[str, float]]) -> Aggregates:
        """Fold one histogram step's recipe metrics in: means of the fractions and SQNR,
        extremes of the scale range. Pure."""
        n, old = self.recipe_probes, self.recipe_metrics or {}
        out: dict[str, dict[str, float]] = {}
        for group, stats in m.items():
            prev = old.get(group)
            if prev is None:
                out[group] = dict(stats)
                continue
            out[group] = {k: (prev[k] * n + v) / (n + 1) for k, v in stats.items()}
            out[group]["log2_scale_min"] = min(prev["log2_scale_min"], stats["log2_scale_min"])
            out[group]["log2_scale_max"] = max(prev["log2_scale_max"], stats["log2_scale_max"])
        return dataclasses.replace(self, recipe_metrics=out, recipe_probes=n + 1)

    def with_eval(self, step: int, ev: dict[str, float]) -> Aggregates:
        return dataclasses.replace(self, evals=(*self.evals, {"step": step, **ev}))

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["evals"] = list(self.evals)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Aggregates:
        """Inverse of :meth:`to_dict`, also after a JSON round trip (non-finite floats are
        stored as strings, see :mod:`precisionlab._io`)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in data.items() if k in names}
        for key in ("running_min", "min_loss_scale", "max_loss_scale", "final_loss"):
            if key in kw:
                kw[key] = from_json_float(kw[key])
        if kw.get("recipe_metrics"):
            kw["recipe_metrics"] = {
                g: {k: from_json_float(v) for k, v in st.items()}
                for g, st in kw["recipe_metrics"].items()
            }
        kw["evals"] = tuple(
            {k: v if k == "step" else from_json_float(v) for k, v in ev.items()}
            for ev in kw.get("evals", ())
        )
        return cls(**kw)


# --- hooks --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepEnd:
    """What a hook sees after each step: ``record`` is the step's metrics dict (plain values)."""

    step: int
    steps: int
    record: dict[str, Any]
    state: TrainState
    aggregates: Aggregates
    last: bool


class Hook(Protocol):
    """Something done after each step (``on_step``) and when the loop ends (``close``)."""

    def on_step(self, end: StepEnd) -> None: ...

    def close(self) -> None: ...


class CallbackHook:
    """Calls ``callback(record)`` after each step."""

    def __init__(self, callback: Callable[[dict[str, Any]], None]) -> None:
        self.callback = callback

    def on_step(self, end: StepEnd) -> None:
        self.callback(end.record)

    def close(self) -> None:
        pass


class CheckpointHook:
    """Saves the state and the aggregates every ``interval`` steps and after the last one."""

    def __init__(self, directory: Any, interval: int) -> None:
        self.directory, self.interval = directory, interval

    def on_step(self, end: StepEnd) -> None:
        if (self.interval and end.step % self.interval == 0) or end.last:
            extra = {"aggregates": end.aggregates.to_dict()}
            save_checkpoint(self.directory, end.state, step=end.step, extra=extra)

    def close(self) -> None:
        pass


class ProgressHook:
    """A tqdm bar on stderr with the loss and the loss scale.

    ``bar`` may be shared by several runs (the experiment runner passes one bar for all its
    variants, so its ETA is the whole run's): a run that stops early advances it by the steps
    it did not do.
    """

    def __init__(self, bar: Any, *, own: bool = True) -> None:
        self.bar, self.own = bar, own
        self.remaining = 0

    @classmethod
    def for_run(cls, total: int, initial: int, desc: str | None) -> ProgressHook:
        from tqdm.auto import tqdm

        return cls(tqdm(total=total, initial=initial, desc=desc, leave=False, dynamic_ncols=True))

    def on_step(self, end: StepEnd) -> None:
        self.bar.update(1)
        self.remaining = end.steps - end.step
        loss, scale = end.record["loss"], end.record["loss_scale"]
        self.bar.set_postfix(loss=f"{loss:.4g}", scale=f"{scale:.3g}")

    def close(self) -> None:
        if self.own:
            self.bar.close()
        elif self.remaining:
            self.bar.update(self.remaining)


# --- evaluation -----------------------------------------------------------------------------


def make_eval_fn(
    loss_fn: Callable, policy: Policy, batches: list[Any]
) -> Callable[[Any], dict[str, float]]:
    """``eval_fn(params) -> {"eval_loss", "eval_metric"}``: mean over ``batches`` of the loss and
    of aux ``metric`` (nan if absent), with params cast to the compute dtype. Jitted."""
    f = normalize_loss_fn(loss_fn)
    stacked = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *batches)

    @jax.jit
    def run(params, stacked):
        pc = cast_floating(params, policy.compute_dtype)

        def one(carry, b):
            loss, aux = f(pc, b)
            metric = aux.get("metric", jnp.nan) if isinstance(aux, dict) else jnp.nan
            return carry, (loss.astype(jnp.float32), jnp.asarray(metric, jnp.float32))

        _, (losses, metrics) = jax.lax.scan(one, None, stacked)
        return jnp.mean(losses), jnp.mean(metrics)

    def eval_fn(params: Any) -> dict[str, float]:
        loss, metric = run(params, stacked)
        return {"eval_loss": float(loss), "eval_metric": float(metric)}

    return eval_fn


def evaluate(
    model_or_loss_fn: Any,
    params: Any,
    batches: list[Any],
    *,
    policy: Policy | str = "p=f32,c=f32,o=f32",
) -> dict[str, float]:
    """Evaluate a built-in Model (or a ``loss_fn``) on ``batches``: eval_loss, eval_metric."""
    pol = get_policy(policy)
    loss_fn = (
        model_or_loss_fn.loss_fn(pol) if hasattr(model_or_loss_fn, "loss_fn") else model_or_loss_fn
    )
    return make_eval_fn(loss_fn, pol, batches)(params)


# --- the loop -------------------------------------------------------------------------------


def _host(x: Any) -> Any:
    x = np.asarray(x)
    if x.shape == ():
        return bool(x) if x.dtype == bool else float(x)
    return x.tolist()


def _hist_dict(h: dict[str, Any] | None) -> dict[str, Any] | None:
    if h is None:
        return None
    return {
        "edges": hist_edges().tolist(),
        "counts": np.asarray(h["counts"]).tolist(),
        "zeros": int(h["zeros"]),
        "nonfinite": int(h["nonfinite"]),
    }


def _weighted(loss_fn: Callable, weight: float) -> Callable:
    """``loss_fn`` with its (float32) loss multiplied by ``weight``."""
    f = normalize_loss_fn(loss_fn)
    w = jnp.float32(weight)

    def weighted(params: Any, batch: Any) -> Any:
        loss, aux = f(params, batch)
        return loss.astype(jnp.float32) * w, aux

    return weighted


def _record(metrics: dict[str, Any], step: int, params: Any, loss_weight: float) -> dict[str, Any]:
    """The host-side record of a step's device metrics."""
    metrics = jax.device_get(metrics)
    flags = metrics.pop("finite_leaves", None)
    rec: dict[str, Any] = {"step": step}
    rec.update({k: _host(v) for k, v in metrics.items()})
    rec["skipped"] = bool(rec["skipped"])
    # A non-finite loss means the forward pass overflowed; otherwise the backward did.
    reason = "nonfinite_loss" if not math.isfinite(rec["loss"]) else "nonfinite_grads"
    rec["skip_reason"] = reason if rec["skipped"] else ""
    if loss_weight != 1:
        rec["loss"] /= loss_weight  # the plain loss, not the weighted one
    if flags is not None:
        rec["nonfinite_leaves"] = nonfinite_leaf_names(params, flags) if rec["skipped"] else []
    return rec


def _probe_record(out: dict[str, Any], hist: bool) -> dict[str, Any]:
    rec: dict[str, Any] = {}
    if hist:
        rec["grad_hist"] = _hist_dict(out["grad_hist"])
        rec["act_hist"] = _hist_dict(out["act_hist"])
    if "shadow_cosine" in out:
        rec["shadow_cosine"] = float(out["shadow_cosine"])
        rec["shadow_underflow_lost"] = float(out["shadow_underflow_lost"])
    return rec


def _split_specs(specs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    loop_names = {f.name for f in dataclasses.fields(LoopOptions)}
    step_names = {f.name for f in dataclasses.fields(StepOptions)}
    unknown = sorted(set(specs) - loop_names - step_names)
    if unknown:
        raise TypeError(
            f"train_loop got unknown keyword(s) {', '.join(unknown)}; allowed: "
            f"{', '.join(sorted(loop_names | step_names))}"
        )
    return (
        {k: v for k, v in specs.items() if k in loop_names},
        {k: v for k, v in specs.items() if k in step_names},
    )


def train_loop(
    loss_fn: Callable,
    params: Any,
    optimizer: optax.GradientTransformation,
    batches: Iterable[Any] | Callable[[int], Iterator[Any]],
    *,
    options: StepOptions | None = None,
    loop: LoopOptions | None = None,
    eval_fn: Callable[[Any], dict[str, float]] | None = None,
    probe_loss_fn: Callable | None = None,
    shadow_loss_fn: Callable | None = None,
    lr_schedule: Callable[[int], Any] | None = None,
    checkpoint_dir: Any = None,
    resume: bool = False,
    callback: Callable[[dict[str, Any]], None] | None = None,
    hooks: Sequence[Hook] = (),
    progress: bool | None = None,
    desc: str | None = None,
    **specs: Any,
) -> TrainResult:
    """Train ``loss_fn``; returns a :class:`~precisionlab.train.config.TrainResult`.

    Args:
      batches: an iterable of batches, or ``batches(start_step) -> iterator`` (preferred: resume
        then starts the data at the checkpoint's step; an iterable is advanced by skipping).
      options / loop: the step's and the loop's options; or give their fields as keywords
        (``steps=300, policy="p=f32,c=f16,o=f32", loss_scale="dynamic", eval_interval=...``),
        parsed here into those objects.
      eval_fn: ``eval_fn(params) -> {"eval_loss", "eval_metric"}``, run every
        ``loop.eval_interval`` steps (0: only at the end) and after the last step; not weighted.
      probe_loss_fn / shadow_loss_fn: every ``loop.hist_interval`` steps, histograms of
        log2|grad| and of the activations (``probe_loss_fn``'s aux "activations"; default
        ``loss_fn``), and the fp32 shadow comparison (also every ``shadow_interval`` steps).
      lr_schedule: optax count -> learning rate, reported as ``lr``: the rate this step applied
        (optax counts applied updates only, so skipped steps do not advance it).
      checkpoint_dir / resume: checkpoints every ``loop.checkpoint_interval`` steps and at the
        end; ``resume`` continues from the newest one (bitwise as if uninterrupted).
      callback, hooks, progress, desc: what runs after each step: ``callback(record)``, the
        given hooks, and a tqdm bar labelled ``desc`` (``progress`` None: only on a terminal).

    ``loop.loss_weight`` multiplies the loss of ``loss_fn``, ``probe_loss_fn`` and
    ``shadow_loss_fn`` (in float32) before differentiation; the recorded ``loss`` is divided back.
    A step whose loss is non-finite or > ``divergence_k`` x the least loss so far marks the run
    diverged; ``divergence_action`` "stop" ends it there.
    """
    loop_kw, step_kw = _split_specs(specs)
    if loop is None:
        loop = LoopOptions(**loop_kw)
    elif loop_kw:
        raise TypeError(f"give loop options in `loop` or as keywords, not both: {sorted(loop_kw)}")
    if options is None:
        options = StepOptions.parse(**step_kw)
    elif step_kw:
        raise TypeError(f"give step options in `options` or as keywords: {sorted(step_kw)}")
    if loop.checkpoint_interval and checkpoint_dir is None:
        raise ValueError("checkpoint_interval needs a checkpoint_dir")
    if loop.loss_weight != 1:
        w = loop.loss_weight
        loss_fn = _weighted(loss_fn, w)
        probe_loss_fn = None if probe_loss_fn is None else _weighted(probe_loss_fn, w)
        shadow_loss_fn = None if shadow_loss_fn is None else _weighted(shadow_loss_fn, w)
    example = None
    if options.recipe is not None and options.recipe.stateful:
        # the recipe's state has one entry per matmul, found by tracing with a batch
        if callable(batches) and not isinstance(batches, Iterable):
            example = next(iter(batches(0)))
        else:
            peek = iter(batches)
            example = next(peek)
            batches = itertools.chain([example], peek)
    step_fn, state, mesh = build_step(loss_fn, params, optimizer, options, example)
    jstep = jax.jit(step_fn, donate_argnums=0)
    telemetry_names = getattr(step_fn, "telemetry_names", {})  # filled when the step is traced
    probe = None
    if loop.hist_interval or (shadow_loss_fn is not None and loop.shadow_interval):
        probe_fn = make_probe_fn(
            probe_loss_fn or loss_fn,
            policy=options.policy,
            shadow_loss_fn=shadow_loss_fn,
            histograms=bool(loop.hist_interval),
        )
        probe = jax.jit(probe_fn)
    recipe_probe = None
    if loop.hist_interval and options.recipe is not None:
        from precisionlab.train.recipe_metrics import make_recipe_metrics_fn

        rfn = make_recipe_metrics_fn(loss_fn, options.recipe)
        pol = options.policy

        def recipe_probe_fn(state, batch):
            pc = cast_floating(state.params, pol.compute_dtype)
            key = jax.random.fold_in(state.rng, 0x57A7)
            return rfn(pc, batch, state.loss_scale, state.recipe_state, key)

        recipe_probe = jax.jit(recipe_probe_fn)

    agg, start = Aggregates(), 0
    # In a multi-process run, process 0 reads the checkpoint and the others receive it.
    found = None
    if resume and checkpoint_dir is not None:
        found = restore_checkpoint(checkpoint_dir, state)
    if found is not None:
        state, start, extra = found
        agg = Aggregates.from_dict(extra.get("aggregates", {}))
    # The step donates its state: copy it so the caller's params stay alive.
    state = jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), state)
    shard = None
    if mesh is not None:
        from precisionlab.train.parallel import place_state, shard_batch

        state = place_state(state, mesh, options.zero_stage)
        shard = lambda b: shard_batch(b, mesh)  # noqa: E731
    it = _batches_from(batches, start)

    all_hooks = [CallbackHook(callback)] if callback is not None else []
    all_hooks += list(hooks)
    if progress if progress is not None else sys.stderr.isatty():
        all_hooks.append(ProgressHook.for_run(loop.steps, start, desc))
    if checkpoint_dir is not None and is_main():  # only process 0 writes
        all_hooks.append(CheckpointHook(checkpoint_dir, loop.checkpoint_interval))

    def stopped() -> bool:
        return agg.diverged and loop.divergence_action == "stop"

    records: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    step = start
    try:
        while step < loop.steps and not stopped():
            batch = next(it) if shard is None else shard(next(it))
            ts = time.perf_counter()
            hist = bool(loop.hist_interval) and step % loop.hist_interval == 0
            shadow = shadow_loss_fn is not None and (
                hist or (bool(loop.shadow_interval) and step % loop.shadow_interval == 0)
            )
            probed = jax.device_get(probe(state, batch)) if probe and (hist or shadow) else None
            rmetrics = None
            if recipe_probe is not None and hist:
                from precisionlab.train.recipe_metrics import recipe_metrics

                rmetrics = recipe_metrics(recipe_probe(state, batch))
            state, metrics = jstep(state, batch)
            tel = metrics.pop("telemetry", None)
            step += 1
            rec = _record(metrics, step, params, loop.loss_weight)
            if tel is not None and options.telemetry.due(step - 1):
                # one row per layer and tensor (see precisionlab.train.telemetry)
                rec["telemetry"] = telemetry_rows(
                    jax.device_get(tel), telemetry_names, step, options.telemetry.targets
                )
            if lr_schedule is not None:
                rec["lr"] = float(lr_schedule(step - 1 - agg.skipped_steps))
            rec["step_time_s"] = time.perf_counter() - ts
            if probed is not None:
                rec.update(_probe_record(probed, hist))
            if rmetrics is not None:
                for group, stats in rmetrics.items():
                    rec.update({f"recipe_{group}_{k}": v for k, v in stats.items()})
                agg = agg.with_recipe_metrics(rmetrics)
            agg = agg.update(step, rec, loop.divergence_k)
            rec["diverged"] = agg.diverged
            last = step >= loop.steps or stopped()
            if eval_fn is not None and (
                (loop.eval_interval and step % loop.eval_interval == 0) or last
            ):
                ev = eval_fn(state.params)
                rec.update(ev)
                agg = agg.with_eval(step, ev)
            records.append(rec)
            end = StepEnd(step, loop.steps, rec, state, agg, last)
            for hook in all_hooks:
                hook.on_step(end)
    finally:
        for hook in all_hooks:
            hook.close()
    return _result(state, step, agg, time.perf_counter() - t0, records)


def _batches_from(batches: Any, start: int) -> Iterator[Any]:
    if callable(batches) and not isinstance(batches, Iterable):
        return iter(batches(start))
    it = iter(batches)
    for _ in range(start):
        next(it)
    return it


def _result(state: Any, steps: int, agg: Aggregates, wall: float, records: list) -> TrainResult:
    last_eval = agg.evals[-1] if agg.evals else {}
    return TrainResult(
        state=state,
        steps_done=steps,
        final_loss=agg.final_loss,
        eval_loss=last_eval.get("eval_loss"),
        eval_metric=last_eval.get("eval_metric"),
        evals=list(agg.evals),
        skipped_steps=agg.skipped_steps,
        diverged=agg.diverged,
        divergence_step=agg.divergence_step,
        min_loss_scale=agg.min_loss_scale,
        max_loss_scale=agg.max_loss_scale,
        mean_underflow_fraction=agg.underflow_sum / max(steps, 1),
        wall_time_s=wall,
        metrics=records,
        recipe_metrics=agg.recipe_metrics,
    )


# --- from a config ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrainSetup:
    """Everything a :class:`TrainConfig` describes, built: the typed objects the loop takes.

    data, model, optimizer (optax), schedule (count -> lr), params (float32, from the seed),
    loss_fn (the model's loss under the policy), eval_batches (the same for every seed),
    options (:class:`StepOptions`), loop (:class:`LoopOptions`).
    """

    config: TrainConfig
    data: Dataset
    model: Model
    optimizer: optax.GradientTransformation
    schedule: Callable[[int], Any]
    params: Any
    loss_fn: Callable
    eval_batches: list[Any]
    options: StepOptions
    loop: LoopOptions

    @property
    def policy(self) -> Policy:
        return self.options.policy


def _recipe_without(recipe: Any, layers: tuple[str, ...]) -> Any:
    """``recipe`` with the matmuls of ``layers`` (their ``named_scope``) excluded: ``L/*``
    matches ``L/dot_general[i]`` and the sites of functions jitted inside the layer
    (``L/einsum``), and not ``L0`` for ``L``."""
    if recipe is None or not layers:
        return recipe
    return dataclasses.replace(recipe, exclude=(*recipe.exclude, *(f"{n}/*" for n in layers)))


def build(config: TrainConfig) -> TrainSetup:
    """The pieces of a run built from ``config`` (validated and parsed when it was made)."""
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    precision = config.precision
    data = make_data(config.data, **config.data_kwargs)
    model_kwargs = {**data.model_kwargs(), **config.model_kwargs}
    if config.remat:
        model_kwargs["remat"] = True
    if config.high_precision:
        model_kwargs["high_precision"] = config.high_precision
    if config.scan_layers:
        model_kwargs.update(
            scan_layers=True, remat_every=config.remat_every, remat_policy=config.remat_policy
        )
    model = make_model(config.model, **model_kwargs)
    sched = dict(steps=config.steps, warmup_steps=config.warmup_steps)
    optimizer = make_optimizer(
        config.optimizer,
        config.lr,
        schedule=config.schedule,
        weight_decay=config.weight_decay,
        grad_clip=config.grad_clip,
        **sched,
        **config.optimizer_kwargs,
    )
    options = StepOptions(
        policy=precision.policy,
        loss_scale=precision.loss_scale,
        storage=precision.storage,
        microbatches=config.microbatches,
        seed=config.seed,
        # several processes train one model: data parallel over all their devices
        data_parallel=config.data_parallel or jax.process_count() > 1,
        allreduce_dtype=precision.allreduce_dtype,
        zero_stage=config.zero_stage,
        report_leaves=config.report_leaves,
        recipe=_recipe_without(precision.recipe, config.high_precision),
        fp32_params=tuple(model.layer_params(n) for n in config.high_precision),
        telemetry=parse_telemetry(config.telemetry, config.steps),
    )
    loop = LoopOptions(
        steps=config.steps,
        eval_interval=config.eval_interval,
        checkpoint_interval=config.checkpoint_interval,
        divergence_k=config.divergence_k,
        divergence_action=config.divergence_action,
        hist_interval=config.hist_interval,
        shadow_interval=config.shadow_interval,
        loss_weight=config.loss_weight,
    )
    return TrainSetup(
        config=config,
        data=data,
        model=model,
        optimizer=optimizer,
        schedule=make_schedule(config.lr, config.schedule, **sched),
        params=model.init(jax.random.PRNGKey(config.seed)),
        loss_fn=model.loss_fn(precision.policy, enforce=config.enforce_numerics),
        # The eval set is the same for every seed, so variants of an experiment are comparable.
        eval_batches=data.eval_batches(config.eval_batches, config.batch_size, seed=0),
        options=options,
        loop=loop,
    )


def train(
    config: TrainConfig,
    *,
    callback: Callable[[dict[str, Any]], None] | None = None,
    checkpoint_dir: Any = None,
    resume: bool = False,
    quiet: bool = False,
    hooks: Sequence[Hook] = (),
) -> TrainResult:
    """Run the training described by ``config`` (see the package docstring for the metrics).

    ``hooks`` run after each step (after ``callback``); ``quiet`` turns off the progress bar.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    if config.checkpoint_interval and checkpoint_dir is None:
        raise ValueError("checkpoint_interval > 0 needs a checkpoint_dir")
    setup = build(config)
    policy, model = setup.policy, setup.model
    enforce = config.enforce_numerics
    return train_loop(
        setup.loss_fn,
        setup.params,
        setup.optimizer,
        lambda start: setup.data.batches(config.batch_size, seed=config.seed, start=start),
        options=setup.options,
        loop=setup.loop,
        eval_fn=make_eval_fn(setup.loss_fn, policy, setup.eval_batches),
        probe_loss_fn=model.loss_fn(policy, capture=True, enforce=enforce),
        shadow_loss_fn=model.loss_fn(Policy(), enforce=False) if config.shadow else None,
        lr_schedule=setup.schedule,
        checkpoint_dir=checkpoint_dir,
        resume=resume,
        callback=callback,
        hooks=hooks,
        progress=False if quiet else config.progress,
        desc=f"{config.model} {policy}",
    )
