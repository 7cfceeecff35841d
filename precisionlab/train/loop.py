"""The training loop: jitted steps, metrics, evaluation, divergence detection, hooks.

:func:`train_loop` runs any ``loss_fn`` over any batch source with :class:`LoopOptions` and
:class:`~precisionlab.train.step.StepOptions`; what happens around a step is a list of
:class:`~precisionlab.train.hooks.Hook` objects, and the run's totals are an
:class:`~precisionlab.train.aggregates.Aggregates` value updated by a pure function. Building the
pieces from a config is :mod:`precisionlab.train.compose`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import sys
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from precisionlab.mixed.loss_scale import nonfinite_leaf_names
from precisionlab.mixed.policy import cast_floating
from precisionlab.train.aggregates import Aggregates
from precisionlab.train.config import (
    DIVERGENCE_ACTIONS,
    TrainResult,
    check_loss_weight,
)
from precisionlab.train.deterministic import fixed_order
from precisionlab.train.distributed import is_main, restore_checkpoint
from precisionlab.train.hooks import CallbackHook, CheckpointHook, Hook, ProgressHook, StepEnd
from precisionlab.train.meters import hist_edges
from precisionlab.train.predictors import predictor_row
from precisionlab.train.programs import get as shared_programs
from precisionlab.train.step import (
    StepOptions,
    build_step,
    make_probe_fn,
    weighted_loss,
)
from precisionlab.train.telemetry import telemetry_rows
from precisionlab.train.timing import LoopTimings

__all__ = ["LoopOptions", "compile_programs", "train_loop"]


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
    chunk_steps: int = 0
    #: matmuls and sums of every program in a fixed order (precisionlab.train.deterministic)
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.divergence_action not in DIVERGENCE_ACTIONS:
            raise ValueError(
                f"unknown divergence_action {self.divergence_action!r}; allowed: "
                f"{', '.join(DIVERGENCE_ACTIONS)}"
            )
        check_loss_weight(self.loss_weight)
        c = self.chunk_steps
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise ValueError(f"chunk_steps must be an int >= 0 (0: automatic), got {c!r}")


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
    timings: LoopTimings | None = None,
    values: Mapping[str, float] | None = None,
    program_key: Hashable | None = None,
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

    Steps run ``loop.chunk_steps`` at a time in one compiled call (``lax.scan`` over the step;
    0: the greatest common divisor of the eval, checkpoint, hist and shadow intervals, at most
    :data:`MAX_CHUNK`), their metrics fetched once per call; probes, evaluations and checkpoints
    fall on call boundaries, and the results are bitwise those of one call per step
    (``chunk_steps=1``). ``timings`` (a :class:`~precisionlab.train.timing.LoopTimings`)
    receives where the time went.

    ``loop.loss_weight`` multiplies the loss of ``loss_fn``, ``probe_loss_fn`` and
    ``shadow_loss_fn`` (in float32) before differentiation; the recorded ``loss`` is divided back.
    It is one of the state's ``values`` (arguments of the compiled programs, see
    :func:`~precisionlab.train.step.build_step`), with ``values`` given here (``optimizer``
    may then be an :data:`~precisionlab.train.step.OptimizerFactory`). ``program_key``
    (hashable) names the structure of the programs: runs with the same key share their jitted
    step, chunk and probe functions (:mod:`precisionlab.train.programs`), traced and compiled
    once; the caller vouches that such runs differ only in ``values``, params, data and seeds.
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
    run = _prepare(
        loss_fn, params, optimizer, batches, options, loop, probe_loss_fn, shadow_loss_fn,
        values, program_key,
    )  # fmt: skip
    state, mesh, chunk, programs, batches = (
        run.state,
        run.mesh,
        run.chunk,
        run.programs,
        run.batches,
    )
    if timings is not None:
        timings.chunk_steps = chunk
    jstep, jchunk, probe = programs.step, programs.chunk, programs.probe
    recipe_probe = programs.recipe
    telemetry_names = programs.telemetry_names

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

    clock = _Clock(timings)
    records: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    step = start
    meter = timings.compile if timings is not None else contextlib.nullcontext()
    try:
        with meter:
            while step < loop.steps and not stopped():
                n = _chunk_len(step, chunk, loop)
                with clock("data_s"):
                    raw = [next(it) for _ in range(n)]
                batch = raw[0] if shard is None else shard(raw[0])
                hist = bool(loop.hist_interval) and step % loop.hist_interval == 0
                shadow = shadow_loss_fn is not None and (
                    hist or (bool(loop.shadow_interval) and step % loop.shadow_interval == 0)
                )
                probed, rmetrics = None, None
                with clock("probe_s"):
                    if probe and (hist or shadow):
                        probed = jax.device_get(probe(state, batch))
                        clock.sync()
                    if recipe_probe is not None and hist:
                        from precisionlab.train.recipe_metrics import recipe_metrics

                        rmetrics = recipe_metrics(recipe_probe(state, batch))
                        clock.sync()
                with clock("hooks_s"):  # a hook that reads the state a step starts from
                    for hook in all_hooks:
                        before = getattr(hook, "before_step", None)
                        if before is not None:
                            before(step, state, raw[0])
                ts = time.perf_counter()
                if chunk == 1:
                    state, metrics = jstep(state, batch)
                    fetched = [jax.device_get(metrics)]
                else:
                    with clock("data_s"):
                        stacked = _stack(raw + raw[-1:] * (chunk - n))  # padding is not run
                    state, metrics = jchunk(state, stacked, jnp.int32(n))
                    stacked_metrics = jax.device_get(metrics)
                    fetched = [
                        jax.tree_util.tree_map(lambda x, i=i: x[i], stacked_metrics)
                        for i in range(n)
                    ]
                clock.sync()
                elapsed = time.perf_counter() - ts
                clock.call(elapsed, n)
                for i, m in enumerate(fetched):
                    tel = m.pop("telemetry", None)
                    pred = m.pop("predictors", None)
                    step += 1
                    rec = _record(m, step, params, loop.loss_weight)
                    if pred is not None and options.predictors.due(step - 1):
                        rec["predictors"] = predictor_row(pred, step)
                    if tel is not None and options.telemetry.due(step - 1):
                        # one row per layer and tensor (see precisionlab.train.telemetry)
                        rec["telemetry"] = telemetry_rows(
                            tel, telemetry_names, step, options.telemetry.targets
                        )
                    if lr_schedule is not None:
                        rec["lr"] = float(lr_schedule(step - 1 - agg.skipped_steps))
                    rec["step_time_s"] = elapsed / n
                    if i == 0 and probed is not None:
                        rec.update(_probe_record(probed, hist))
                    if i == 0 and rmetrics is not None:
                        for group, stats in rmetrics.items():
                            rec.update({f"recipe_{group}_{k}": v for k, v in stats.items()})
                        agg = agg.with_recipe_metrics(rmetrics)
                    agg = agg.update(step, rec, loop.divergence_k)
                    rec["diverged"] = agg.diverged
                    last = step >= loop.steps or stopped()
                    # the state after this step exists only at the end of its call
                    at_end = i == len(fetched) - 1 or last
                    if eval_fn is not None and (
                        (loop.eval_interval and step % loop.eval_interval == 0) or last
                    ):
                        assert at_end, "an eval step ends its chunk (_chunk_len)"
                        with clock("eval_s"):
                            ev = eval_fn(state.params)
                            clock.sync()
                        rec.update(ev)
                        agg = agg.with_eval(step, ev)
                    records.append(rec)
                    end = StepEnd(step, loop.steps, rec, state if at_end else None, agg, last)
                    with clock("hooks_s"):
                        for hook in all_hooks:
                            hook.on_step(end)
                    if last:
                        break
    finally:
        for hook in all_hooks:
            hook.close()
    return _result(state, step, agg, time.perf_counter() - t0, records)


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """A run's initial state, mesh, steps per call, jitted programs and batch source."""

    state: Any
    mesh: Any
    chunk: int
    programs: _Programs
    batches: Any


def _prepare(
    loss_fn: Callable,
    params: Any,
    optimizer: Any,
    batches: Any,
    options: StepOptions,
    loop: LoopOptions,
    probe_loss_fn: Callable | None,
    shadow_loss_fn: Callable | None,
    values: Mapping[str, float] | None,
    program_key: Hashable | None,
) -> _Prepared:
    """The step built (its values include ``loop.loss_weight``) and its programs, shared under
    ``program_key``; nothing is compiled here."""
    vals = dict(values or {})
    if vals or loop.loss_weight != 1:
        vals["loss_weight"] = loop.loss_weight
    example = None
    if options.recipe is not None and options.recipe.stateful:
        # the recipe's state has one entry per matmul, found by tracing with a batch
        if callable(batches) and not isinstance(batches, Iterable):
            example = next(iter(batches(0)))
        else:
            peek = iter(batches)
            example = next(peek)
            batches = itertools.chain([example], peek)
    step_fn, state, mesh = build_step(loss_fn, params, optimizer, options, example, vals or None)
    chunk = _chunk_steps(loop, mesh)
    halt = loop.divergence_action == "stop"

    def make_programs() -> _Programs:
        return _programs(step_fn, loss_fn, probe_loss_fn, shadow_loss_fn, options, loop, chunk)

    if program_key is None:
        programs = make_programs()
    else:
        programs = shared_programs((program_key, chunk, halt), make_programs)
    return _Prepared(state, mesh, chunk, programs, batches)


def compile_programs(
    loss_fn: Callable,
    params: Any,
    optimizer: Any,
    batches: Callable[[int], Iterator[Any]],
    *,
    options: StepOptions,
    loop: LoopOptions,
    probe_loss_fn: Callable | None = None,
    shadow_loss_fn: Callable | None = None,
    values: Mapping[str, float] | None = None,
    program_key: Hashable,
) -> Any:
    """Compile the programs :func:`train_loop` runs with these arguments and ``program_key``
    (step or chunk, probes), so that run finds them compiled; returns its initial params (for
    compiling its evaluation). XLA compiles outside the Python lock: call it in a thread to
    compile one run while another trains. Nothing for a data-parallel run (None)."""
    run = _prepare(
        loss_fn, params, optimizer, batches, options, loop, probe_loss_fn, shadow_loss_fn,
        values, program_key,
    )  # fmt: skip
    if run.mesh is not None:
        return None
    state = jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), run.state)
    batch = next(iter(run.batches(0)))
    progs = run.programs
    if progs.chunk is not None:
        stacked = _stack([batch] * run.chunk)
        progs.chunk.lower(state, stacked, jnp.int32(run.chunk)).compile()
    else:
        progs.step.lower(state, batch).compile()
    for probe in (progs.probe, progs.recipe):
        if probe is not None:
            probe.lower(state, batch).compile()
    return state.params


@dataclasses.dataclass(frozen=True)
class _Programs:
    """The jitted functions of a run (see :func:`_programs`)."""

    step: Callable | None
    chunk: Callable | None
    probe: Callable | None
    recipe: Callable | None
    telemetry_names: dict[str, Any]


def _programs(
    step_fn: Callable,
    loss_fn: Callable,
    probe_loss_fn: Callable | None,
    shadow_loss_fn: Callable | None,
    options: StepOptions,
    loop: LoopOptions,
    chunk: int,
) -> _Programs:
    """The jitted step (one step per call) or chunk (``chunk`` steps per call), the probe
    (histograms, shadow) and the recipe probe of a run; nothing is traced until called."""
    halt = loop.divergence_action == "stop"
    jstep = jchunk = None
    names_of = step_fn  # telemetry names are filled on it when traced
    if loop.deterministic:
        step_fn = fixed_order(step_fn)
    if chunk == 1:
        jstep = jax.jit(step_fn, donate_argnums=0)
    else:
        jchunk = jax.jit(_chunked(step_fn, chunk, halt), donate_argnums=0)
    probe = None
    if loop.hist_interval or (shadow_loss_fn is not None and loop.shadow_interval):
        probe_fn = make_probe_fn(
            probe_loss_fn or loss_fn,
            policy=options.policy,
            shadow_loss_fn=shadow_loss_fn,
            histograms=bool(loop.hist_interval),
        )
        probe = jax.jit(fixed_order(probe_fn) if loop.deterministic else probe_fn)
    recipe_probe = None
    if loop.hist_interval and options.recipe is not None:
        from precisionlab.train.recipe_metrics import make_recipe_metrics_fn

        recipe, pol = options.recipe, options.policy

        def recipe_probe_fn(state, batch):
            rec = recipe.for_values(state.values)
            rfn = make_recipe_metrics_fn(weighted_loss(loss_fn, state.values), rec)
            pc = cast_floating(state.params, pol.compute_dtype)
            key = jax.random.fold_in(state.rng, 0x57A7)
            return rfn(pc, batch, state.loss_scale, state.recipe_state, key)

        recipe_probe = jax.jit(recipe_probe_fn)
    names = getattr(names_of, "telemetry_names", {})  # filled when the step is traced
    return _Programs(jstep, jchunk, probe, recipe_probe, names)


#: The most steps one compiled call runs (the stacked batches and metrics of a call stay on the
#: device together).
MAX_CHUNK = 100


def _chunk_steps(loop: LoopOptions, mesh: Any) -> int:
    """Steps per compiled call: ``loop.chunk_steps``, or (0) the greatest common divisor of the
    loop's intervals (so probes, evaluations and checkpoints fall on chunk boundaries) capped at
    :data:`MAX_CHUNK`. One step per call for a data-parallel step (its batches are sharded one
    at a time) and for ``divergence_k`` with "stop" (the host decides that divergence)."""
    if mesh is not None or (loop.divergence_k is not None and loop.divergence_action == "stop"):
        return 1
    if loop.chunk_steps:
        return min(loop.chunk_steps, loop.steps)
    intervals = [
        i
        for i in (loop.eval_interval, loop.checkpoint_interval, loop.hist_interval,
                  loop.shadow_interval)
        if i
    ]  # fmt: skip
    k = math.gcd(*intervals) if intervals else loop.steps
    while k > MAX_CHUNK:  # the largest divisor of k within the cap
        k = next(d for d in range(MAX_CHUNK, 0, -1) if k % d == 0)
    return max(1, min(k, loop.steps))


def _chunk_len(step: int, chunk: int, loop: LoopOptions) -> int:
    """The steps of the call starting after ``step`` steps: at most ``chunk``, ending at the
    run's end and at the next step with a probe (before it), an evaluation or a checkpoint
    (after it), so those see the state they would see stepping one at a time."""
    n = min(chunk, loop.steps - step)
    for interval in (loop.eval_interval, loop.checkpoint_interval, loop.hist_interval,
                     loop.shadow_interval):  # fmt: skip
        if interval:
            n = min(n, interval - step % interval)
    return n


def _stack(batches: list[Any]) -> Any:
    return jax.tree_util.tree_map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *batches)


def _chunked(step_fn: Callable, chunk: int, halt: bool) -> Callable:
    """``run(state, batches[chunk, ...], n) -> (state, metrics[chunk, ...])``: ``step_fn`` over
    the first ``n`` batches under ``lax.scan`` (the rest are padding: the state passes through
    and their metrics are zeros). With ``halt``, the steps after one whose loss is not finite
    are not run either (the loop stops at that step, as it does stepping one at a time)."""

    # Jitted inside, so the scan's body reuses the trace made for the metrics' shapes (measured:
    # tracing and lowering the main job's chunk took 1.2-1.3 s of CPU instead of 1.6-2.2 s).
    step_jit = jax.jit(step_fn)

    def run(state: Any, batches: Any, n: jax.Array) -> tuple[Any, Any]:
        first = jax.tree_util.tree_map(lambda x: x[0], batches)
        shapes = jax.eval_shape(step_jit, state, first)[1]
        zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

        def body(carry, xs):
            st, stop = carry
            i, batch = xs

            def active(st):
                return step_jit(st, batch)

            def idle(st):
                return st, zeros

            st, metrics = jax.lax.cond((i < n) & ~stop, active, idle, st)
            if halt:
                stop = stop | ((i < n) & ~jnp.isfinite(metrics["loss"]))
            return (st, stop), metrics

        (state, _), metrics = jax.lax.scan(
            body, (state, jnp.zeros((), bool)), (jnp.arange(chunk), batches)
        )
        return state, metrics

    return run


class _Clock:
    """Adds seconds and syncs to a LoopTimings (does nothing without one)."""

    def __init__(self, timings: LoopTimings | None) -> None:
        self.timings = timings

    @contextlib.contextmanager
    def __call__(self, field: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            if self.timings is not None:
                setattr(self.timings, field, getattr(self.timings, field) + time.perf_counter() - t)

    def sync(self) -> None:
        if self.timings is not None:
            self.timings.host_syncs += 1

    def call(self, seconds: float, steps: int) -> None:
        if self.timings is not None:
            self.timings.call(seconds, steps)


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
