"""The training loop: jitted steps, metrics, evaluation, checkpoints, divergence detection.

:func:`train_loop` runs any ``loss_fn`` over any batch source; :func:`train` builds model, data,
optimizer, policy and loss scale from a :class:`~precisionlab.train.config.TrainConfig`.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from precisionlab.mixed.loss_scale import LossScale, nonfinite_leaf_names
from precisionlab.mixed.policy import Policy, cast_floating, get_policy
from precisionlab.mixed.storage import Storage
from precisionlab.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from precisionlab.train.config import (
    DIVERGENCE_ACTIONS,
    TrainConfig,
    TrainResult,
    check_loss_weight,
)
from precisionlab.train.data import make_data
from precisionlab.train.meters import hist_edges
from precisionlab.train.models import make_model
from precisionlab.train.optim import make_optimizer, make_schedule
from precisionlab.train.step import make_probe_fn, make_train_step, normalize_loss_fn

__all__ = ["evaluate", "make_eval_fn", "train", "train_loop"]

_COMPAT = {"mlp": "classification", "transformer": "lm", "conv": "classification"}


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


def make_eval_fn(
    loss_fn: Callable, policy: Policy | str, batches: list[Any]
) -> Callable[[Any], dict[str, float]]:
    """``eval_fn(params) -> {"eval_loss", "eval_metric"}``: mean over ``batches`` of the loss and
    of aux ``metric`` (nan if absent), with params cast to the compute dtype. Jitted."""
    pol = get_policy(policy)
    f = normalize_loss_fn(loss_fn)
    stacked = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *batches)

    @jax.jit
    def run(params, stacked):
        pc = cast_floating(params, pol.compute_dtype)

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


def _progress(enabled: bool | None, total: int, initial: int, desc: str | None):
    show = sys.stderr.isatty() if enabled is None else enabled
    if not show:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, leave=False, dynamic_ncols=True)


def _weighted(loss_fn: Callable, weight: float) -> Callable:
    """``loss_fn`` with its (float32) loss multiplied by ``weight``."""
    f = normalize_loss_fn(loss_fn)
    w = jnp.float32(weight)

    def weighted(params: Any, batch: Any) -> Any:
        loss, aux = f(params, batch)
        return loss.astype(jnp.float32) * w, aux

    return weighted


def train_loop(
    loss_fn: Callable,
    params: Any,
    optimizer: optax.GradientTransformation,
    batches: Iterable[Any] | Callable[[int], Iterator[Any]],
    *,
    steps: int,
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
    callback: Callable[[dict[str, Any]], None] | None = None,
    eval_fn: Callable[[Any], dict[str, float]] | None = None,
    eval_interval: int = 0,
    checkpoint_dir: str | None = None,
    checkpoint_interval: int = 0,
    resume: bool = False,
    divergence_k: float | None = None,
    divergence_action: str = "stop",
    hist_interval: int = 0,
    probe_loss_fn: Callable | None = None,
    shadow_loss_fn: Callable | None = None,
    shadow_interval: int = 0,
    lr_schedule: Callable[[int], Any] | None = None,
    progress: bool | None = None,
    desc: str | None = None,
    loss_weight: float = 1.0,
) -> TrainResult:
    """Train ``loss_fn`` for ``steps`` steps; see :func:`make_train_step` for the step options.

    Args:
      batches: an iterable of batches, or ``batches(start_step) -> iterator`` (preferred: resume
        then starts the data at the checkpoint's step; an iterable is advanced by skipping).
      callback: called once per step with a dict of plain values (see the package docstring).
      eval_fn: ``eval_fn(params) -> {"eval_loss", "eval_metric"}``, run every ``eval_interval``
        steps (0: only at the end) and after the last step.
      checkpoint_dir / checkpoint_interval: atomic checkpoints every N steps and at the end;
        ``resume`` continues from the newest one (bitwise as if uninterrupted).
      divergence_k: a step whose loss is non-finite or > k * running min of the loss marks the run
        diverged (None: non-finite only); ``divergence_action`` "stop" ends the run there.
      hist_interval: every N steps, histograms of log2|grad| and of the activations (from
        ``probe_loss_fn``'s aux "activations"; default ``loss_fn``), and with ``shadow_loss_fn``
        the fp32 shadow comparison (also every ``shadow_interval`` steps if > 0).
      lr_schedule: step -> learning rate, reported as ``lr`` in the metrics.
      progress: tqdm bar with loss and scale (None: only when stderr is a terminal).
      loss_weight: ``loss_fn``, ``probe_loss_fn`` and ``shadow_loss_fn`` have their loss
        multiplied by it (in float32) before differentiation, as a loss averaged over
        1/loss_weight times more tokens would; the recorded ``loss`` (callback, metrics,
        ``final_loss``, divergence detection) is divided back, i.e. the plain loss. ``eval_fn``
        is not weighted. 1.0: off.
    """
    if divergence_action not in DIVERGENCE_ACTIONS:
        raise ValueError(
            f"unknown divergence_action {divergence_action!r}; allowed: "
            f"{', '.join(DIVERGENCE_ACTIONS)}"
        )
    if checkpoint_interval and checkpoint_dir is None:
        raise ValueError("checkpoint_interval needs a checkpoint_dir")
    check_loss_weight(loss_weight)
    if loss_weight != 1:
        loss_fn = _weighted(loss_fn, loss_weight)
        if probe_loss_fn is not None:
            probe_loss_fn = _weighted(probe_loss_fn, loss_weight)
        if shadow_loss_fn is not None:
            shadow_loss_fn = _weighted(shadow_loss_fn, loss_weight)
    step_fn, state = make_train_step(
        loss_fn,
        params,
        optimizer,
        policy=policy,
        loss_scale=loss_scale,
        storage=storage,
        microbatches=microbatches,
        seed=seed,
        skip_nonfinite=skip_nonfinite,
        skip=skip,
        data_parallel=data_parallel,
        allreduce_dtype=allreduce_dtype,
        report_leaves=report_leaves,
    )
    mesh = step_fn.mesh
    jstep = jax.jit(step_fn, donate_argnums=0)
    probe = None
    if hist_interval or (shadow_loss_fn is not None and shadow_interval):
        probe = jax.jit(
            make_probe_fn(
                probe_loss_fn or loss_fn,
                policy=policy,
                shadow_loss_fn=shadow_loss_fn,
                histograms=bool(hist_interval),
            )
        )
    agg = {
        "diverged": False,
        "divergence_step": None,
        "running_min": math.inf,
        "skipped_steps": 0,
        "min_loss_scale": math.inf,
        "max_loss_scale": -math.inf,
        "underflow_sum": 0.0,
        "final_loss": math.nan,
        "evals": [],
    }
    start = 0
    if resume and checkpoint_dir is not None and latest_checkpoint(checkpoint_dir) is not None:
        state, start, extra = load_checkpoint(checkpoint_dir, state)
        agg.update(extra.get("aggregates", {}))
    # The step donates its state: copy it so the caller's params stay alive.
    state = jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), state)
    if mesh is not None:
        from precisionlab.train.parallel import replicate, shard_batch

        state = replicate(state, mesh)
    if callable(batches) and not isinstance(batches, Iterable):
        it = iter(batches(start))
    else:
        it = iter(batches)
        for _ in range(start):
            next(it)

    def checkpoint(state, step):
        save_checkpoint(checkpoint_dir, state, step=step, extra={"aggregates": agg})

    records: list[dict[str, Any]] = []
    bar = _progress(progress, steps, start, desc)
    t0 = time.perf_counter()
    step = start
    try:
        while step < steps and not (agg["diverged"] and divergence_action == "stop"):
            batch = next(it)
            if mesh is not None:
                batch = shard_batch(batch, mesh)
            ts = time.perf_counter()
            probe_out = None
            do_hist = hist_interval and step % hist_interval == 0
            do_shadow = shadow_loss_fn is not None and (
                do_hist or (shadow_interval and step % shadow_interval == 0)
            )
            if probe is not None and (do_hist or do_shadow):
                probe_out = jax.device_get(probe(state, batch))
            state, metrics = jstep(state, batch)
            metrics = jax.device_get(metrics)
            step += 1
            rec: dict[str, Any] = {"step": step}
            flags = metrics.pop("finite_leaves", None)
            rec.update({k: _host(v) for k, v in metrics.items()})
            rec["skipped"] = bool(rec["skipped"])
            # A non-finite loss means the forward pass overflowed; otherwise the backward did.
            reason = "nonfinite_loss" if not math.isfinite(rec["loss"]) else "nonfinite_grads"
            rec["skip_reason"] = reason if rec["skipped"] else ""
            if loss_weight != 1:
                rec["loss"] /= loss_weight  # the plain loss, not the weighted one
            if report_leaves:
                rec["nonfinite_leaves"] = (
                    nonfinite_leaf_names(params, flags) if rec["skipped"] else []
                )
            if lr_schedule is not None:
                rec["lr"] = float(lr_schedule(step - 1))
            rec["step_time_s"] = time.perf_counter() - ts
            if probe_out is not None:
                if do_hist:
                    rec["grad_hist"] = _hist_dict(probe_out["grad_hist"])
                    rec["act_hist"] = _hist_dict(probe_out["act_hist"])
                if do_shadow and "shadow_cosine" in probe_out:
                    rec["shadow_cosine"] = float(probe_out["shadow_cosine"])
                    rec["shadow_underflow_lost"] = float(probe_out["shadow_underflow_lost"])
            loss = rec["loss"]
            agg["final_loss"] = loss
            agg["skipped_steps"] += int(rec["skipped"])
            agg["min_loss_scale"] = min(agg["min_loss_scale"], rec["loss_scale"])
            agg["max_loss_scale"] = max(agg["max_loss_scale"], rec["loss_scale"])
            agg["underflow_sum"] += rec["underflow_fraction"]
            if not agg["diverged"]:
                bad = not math.isfinite(loss) or (
                    divergence_k is not None
                    and math.isfinite(agg["running_min"])
                    and loss > divergence_k * agg["running_min"]
                )
                if bad:
                    agg["diverged"], agg["divergence_step"] = True, step
            if math.isfinite(loss):
                agg["running_min"] = min(agg["running_min"], loss)
            rec["diverged"] = agg["diverged"]
            last = step >= steps or (agg["diverged"] and divergence_action == "stop")
            if eval_fn is not None and ((eval_interval and step % eval_interval == 0) or last):
                ev = eval_fn(state.params)
                rec.update(ev)
                agg["evals"].append({"step": step, **ev})
            records.append(rec)
            if callback is not None:
                callback(rec)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4g}", scale=f"{rec['loss_scale']:.3g}")
            if checkpoint_dir is not None and (
                (checkpoint_interval and step % checkpoint_interval == 0) or last
            ):
                checkpoint(state, step)
    finally:
        if bar is not None:
            bar.close()
    wall = time.perf_counter() - t0
    n = max(step, 1)
    last_eval = agg["evals"][-1] if agg["evals"] else {}
    return TrainResult(
        state=state,
        steps_done=step,
        final_loss=agg["final_loss"],
        eval_loss=last_eval.get("eval_loss"),
        eval_metric=last_eval.get("eval_metric"),
        evals=list(agg["evals"]),
        skipped_steps=agg["skipped_steps"],
        diverged=agg["diverged"],
        divergence_step=agg["divergence_step"],
        min_loss_scale=agg["min_loss_scale"],
        max_loss_scale=agg["max_loss_scale"],
        mean_underflow_fraction=agg["underflow_sum"] / n,
        wall_time_s=wall,
        metrics=records,
    )


def build(config: TrainConfig) -> dict[str, Any]:
    """The pieces of a run built from ``config``: data, model, policy, loss_fn, optimizer,
    schedule, params (float32, from ``config.seed``), storage, eval batches."""
    data = make_data(config.data, **config.data_kwargs)
    if _COMPAT[config.model] != data.kind:
        raise ValueError(
            f"model {config.model!r} needs a {_COMPAT[config.model]} dataset, but data "
            f"{config.data!r} is {data.kind}"
        )
    mk = {**data.model_kwargs(), **config.model_kwargs}
    if config.remat:
        mk["remat"] = True
    model = make_model(config.model, **mk)
    policy = get_policy(config.policy, fp32_ops=config.fp32_ops)
    schedule = make_schedule(
        config.lr, config.schedule, steps=config.steps, warmup_steps=config.warmup_steps
    )
    optimizer = make_optimizer(
        config.optimizer,
        config.lr,
        schedule=config.schedule,
        steps=config.steps,
        warmup_steps=config.warmup_steps,
        weight_decay=config.weight_decay,
        grad_clip=config.grad_clip,
        **config.optimizer_kwargs,
    )
    storage = Storage(
        params=config.params_dtype,
        grads=config.grads_dtype,
        opt_state=config.opt_state_dtype,
        update=config.update_rounding,
    )
    params = model.init(jax.random.PRNGKey(config.seed))
    # The eval set is the same for every seed, so variants of an experiment are comparable.
    eval_batches = data.eval_batches(config.eval_batches, config.batch_size, seed=0)
    return {
        "data": data,
        "model": model,
        "policy": policy,
        "optimizer": optimizer,
        "schedule": schedule,
        "storage": storage,
        "params": params,
        "loss_fn": model.loss_fn(policy, enforce=config.enforce_numerics),
        "eval_batches": eval_batches,
    }


def train(
    config: TrainConfig,
    *,
    callback: Callable[[dict[str, Any]], None] | None = None,
    checkpoint_dir: str | None = None,
    resume: bool = False,
    quiet: bool = False,
) -> TrainResult:
    """Run the training described by ``config`` (see the package docstring for the metrics)."""
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    if config.checkpoint_interval and checkpoint_dir is None:
        raise ValueError("checkpoint_interval > 0 needs a checkpoint_dir")
    parts = build(config)
    model, policy, data = parts["model"], parts["policy"], parts["data"]
    eval_fn = make_eval_fn(parts["loss_fn"], policy, parts["eval_batches"])
    probe_loss_fn = model.loss_fn(policy, capture=True, enforce=config.enforce_numerics)
    shadow_loss_fn = model.loss_fn(Policy(), enforce=False) if config.shadow else None
    return train_loop(
        parts["loss_fn"],
        parts["params"],
        parts["optimizer"],
        lambda start: data.batches(config.batch_size, seed=config.seed, start=start),
        steps=config.steps,
        policy=policy,
        loss_scale=_loss_scale(config),
        storage=parts["storage"],
        microbatches=config.microbatches,
        seed=config.seed,
        data_parallel=config.data_parallel,
        allreduce_dtype=config.allreduce_dtype,
        report_leaves=config.report_leaves,
        callback=callback,
        eval_fn=eval_fn,
        eval_interval=config.eval_interval,
        checkpoint_dir=checkpoint_dir,
        checkpoint_interval=config.checkpoint_interval,
        resume=resume,
        divergence_k=config.divergence_k,
        divergence_action=config.divergence_action,
        hist_interval=config.hist_interval,
        probe_loss_fn=probe_loss_fn,
        shadow_loss_fn=shadow_loss_fn,
        shadow_interval=config.shadow_interval,
        lr_schedule=parts["schedule"],
        progress=False if quiet else config.progress,
        desc=f"{config.model} {policy}",
        loss_weight=config.loss_weight,
    )


def _loss_scale(config: TrainConfig) -> LossScale:
    from precisionlab.mixed.loss_scale import parse_loss_scale

    return parse_loss_scale(config.loss_scale, **config.loss_scale_kwargs)
