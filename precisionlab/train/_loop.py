"""The training loop: jitted steps, metrics, evaluation, divergence detection, hooks.

:func:`train_loop` runs any ``loss_fn`` over any batch source with :class:`LoopOptions` and
:class:`~precisionlab.train._step.StepOptions`; what happens around a step is a list of
:class:`~precisionlab.train._hooks.Hook` objects, and the run's totals are an
:class:`~precisionlab.train._aggregates.Aggregates` value updated by a pure function. Building the
pieces from a config is :mod:`precisionlab.train._compose`.
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

from precisionlab.mixed._loss_scale import nonfinite_leaf_names
from precisionlab.mixed._policy import cast_floating
from precisionlab.train._aggregates import Aggregates
from precisionlab.train._config import (
    DIVERGENCE_ACTIONS,
    TrainResult,
    check_loss_weight,
)
from precisionlab.train._deterministic import fixed_order
from precisionlab.train._distributed import is_main, restore_checkpoint
from precisionlab.train._hooks import CheckpointHook, Hook, ProgressHook, StepEnd
from precisionlab.train._parallel import place_state, shard_batch
from precisionlab.train._programs import get as shared_programs
from precisionlab.train._recipe_metrics import make_recipe_metrics_fn, measures
from precisionlab.train._record_hooks import (
    EvalHook,
    LrHook,
    MeasureHook,
    PredictorRowHook,
    ProbeHook,
    RecipeMetricsHook,
    RowHook,
    TelemetryRowHook,
)
from precisionlab.train._step import (
    OptimizerFactory,
    StepOptions,
    TrainState,
    build_step,
    make_probe_fn,
    weighted_loss,
)
from precisionlab.train._timing import LoopTimings

__all__ = ["LoopExtras", "LoopOptions", "compile_programs", "train_loop"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopOptions:
    """How the loop runs around the step (see :func:`train_loop`).

    Attributes:
      steps: steps to run (in all, counting those of a resumed checkpoint).
      eval_interval: evaluate every N steps (0: only after the last one).
      checkpoint_interval / checkpoint_dir / resume: checkpoints every N steps and at the end
        into ``checkpoint_dir``; ``resume`` continues from the newest one there (bitwise as if
        uninterrupted).
      divergence_k / divergence_action: a step whose loss is non-finite or > ``divergence_k``
        x the least loss so far marks the run diverged; "stop" ends it there.
      hist_interval: every N steps, histograms of log2|grad| and of the activations, the
        recipe's metrics and the shadow comparison; shadow_interval: the shadow comparison
        also every N steps.
      loss_weight: multiplies the loss (in float32) before differentiation; the recorded
        ``loss`` is divided back. It is one of the state's ``values``.
      chunk_steps: steps per compiled call (``lax.scan`` over the step; 0: the greatest common
        divisor of the intervals, at most :data:`MAX_CHUNK`); results are bitwise those of one
        call per step.
      deterministic: matmuls and sums of every program in a fixed order
        (:mod:`precisionlab.train._deterministic`).
      progress / desc: a tqdm bar labelled ``desc`` (``progress`` None: only on a terminal).
    """

    steps: int
    eval_interval: int = 0
    checkpoint_interval: int = 0
    divergence_k: float | None = None
    divergence_action: str = "stop"
    hist_interval: int = 0
    shadow_interval: int = 0
    loss_weight: float = 1.0
    chunk_steps: int = 0
    deterministic: bool = False
    checkpoint_dir: Any = None
    resume: bool = False
    progress: bool | None = None
    desc: str | None = None

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopExtras:
    """What a run brings besides its loss, params, optimizer and data (see :func:`train_loop`).

    Attributes:
      eval_fn: ``eval_fn(params) -> {"eval_loss", "eval_metric"}`` (not weighted), run every
        ``eval_interval`` steps and after the last one (an :class:`EvalHook`).
      probe_loss_fn: the loss whose aux "activations" the histograms read (default the loss).
      shadow_loss_fn: the same model in float32, for the shadow comparison.
      lr_schedule: optax count -> learning rate, reported as ``lr`` (an :class:`LrHook`).
      values: numbers the compiled programs take as arguments (``TrainState.values``, with
        ``loss_weight``; the optimizer may then be an
        :data:`~precisionlab.train._step.OptimizerFactory`).
      program_key: names the structure of the programs (hashable): runs with the same key
        share their jitted step, chunk and probe functions (:mod:`precisionlab.train._programs`);
        the caller vouches that they differ only in ``values``, params, data and seeds.
      timings: a :class:`~precisionlab.train._timing.LoopTimings` that receives where the time
        went.
    """

    eval_fn: Callable[[Any], dict[str, float]] | None = None
    probe_loss_fn: Callable | None = None
    shadow_loss_fn: Callable | None = None
    lr_schedule: Callable[[int], Any] | None = None
    values: Mapping[str, float] | None = None
    program_key: Hashable | None = None
    timings: LoopTimings | None = None


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


def _host(x: Any) -> Any:
    x = np.asarray(x)
    if x.shape == ():
        return bool(x) if x.dtype == bool else float(x)
    return x.tolist()


def train_loop(
    loss_fn: Callable,
    params: Any,
    optimizer: optax.GradientTransformation | OptimizerFactory,
    batches: Iterable[Any] | Callable[[int], Iterator[Any]],
    *,
    loop: LoopOptions,
    options: StepOptions | None = None,
    extras: LoopExtras | None = None,
    hooks: Sequence[Hook] = (),
) -> TrainResult:
    """Train ``loss_fn`` for ``loop.steps`` steps; returns a :class:`TrainResult`.

    ``batches`` is an iterable of batches or ``batches(start_step) -> iterator`` (preferred:
    resume then starts the data at the checkpoint's step). ``options`` (a :class:`StepOptions`)
    make the step (:func:`~precisionlab.train._step.build_step`), ``loop`` and ``extras`` what
    runs around it, as hooks: probes, recipe metrics (:class:`MeasureHook`), telemetry,
    predictors, lr (:class:`RowHook`), evaluation (:class:`EvalHook`), then ``hooks``
    (``on_step``: a callback, checkpoints, a progress bar, yours). Steps run several per
    compiled call; measurements, evaluations and checkpoints fall on call boundaries.
    """
    options = StepOptions() if options is None else options
    extras = LoopExtras() if extras is None else extras
    run = _prepare(loss_fn, params, optimizer, batches, options, loop, extras)
    state, start, agg = _start(run, loop, options)
    measures, rows, evals = _record_hooks(run.programs, options, loop, extras)
    step_hooks = _step_hooks(hooks, loop, start)
    clock, it = _Clock(extras.timings), _batches_from(run.batches, start)
    records: list[dict[str, Any]] = []
    t0, step = time.perf_counter(), start
    try:
        with clock.run(run.chunk):
            while step < loop.steps and not _stopped(agg, loop):
                n = _chunk_len(step, run.chunk, loop)
                with clock("data_s"):
                    raw = [next(it) for _ in range(n)]
                batch = run.shard(raw[0])
                measured = _measure(measures, step, state, batch, clock)
                _before_step(step_hooks, step, state, raw[0], clock)
                state, fetched, seconds = _call(run, state, batch, raw, clock)
                for i, m in enumerate(fetched):
                    step += 1
                    rec = _step_record(m, step, params, loop.loss_weight, rows, agg)
                    rec["step_time_s"] = seconds / n
                    agg = _fold(rec, agg, measured if i == 0 else [])
                    agg = agg.update(step, rec, loop.divergence_k)
                    rec["diverged"] = agg.diverged
                    last = step >= loop.steps or _stopped(agg, loop)
                    # the state after this step exists only at the end of its call
                    after = state if i == len(fetched) - 1 or last else None
                    agg = _evaluate(evals, step, last, after, rec, agg, clock)
                    records.append(rec)
                    end = StepEnd(step, loop.steps, rec, after, agg, last)
                    _on_step(step_hooks, end, clock)
                    if last:
                        break
    finally:
        for hook in step_hooks:
            hook.close()
    return _result(state, step, agg, time.perf_counter() - t0, records)


def _stopped(agg: Aggregates, loop: LoopOptions) -> bool:
    return agg.diverged and loop.divergence_action == "stop"


def _start(run: _Prepared, loop: LoopOptions, options: StepOptions) -> tuple[Any, int, Aggregates]:
    """The state, step and aggregates the run starts from: the newest checkpoint's with
    ``loop.resume`` (process 0 reads it, the others receive it), else the initial ones."""
    if loop.checkpoint_interval and loop.checkpoint_dir is None:
        raise ValueError("checkpoint_interval needs a checkpoint_dir")
    state, agg, start = run.state, Aggregates(), 0
    found = None
    if loop.resume and loop.checkpoint_dir is not None:
        found = restore_checkpoint(loop.checkpoint_dir, state)
    if found is not None:
        state, start, extra = found
        agg = Aggregates.from_dict(extra.get("aggregates", {}))
    # The step donates its state: copy it so the caller's params stay alive.
    state = jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), state)
    if run.mesh is not None:
        state = place_state(state, run.mesh, options.zero_stage)
    return state, start, agg


def _record_hooks(
    programs: _Programs, options: StepOptions, loop: LoopOptions, extras: LoopExtras
) -> tuple[list[MeasureHook], list[RowHook], list[EvalHook]]:
    """The run's measurements, in the order their fields enter a record."""
    measures: list[MeasureHook] = []
    if programs.probe is not None:
        shadow = None if extras.shadow_loss_fn is None else loop.shadow_interval
        measures.append(ProbeHook(programs.probe, loop.hist_interval, shadow))
    if programs.recipe is not None:
        measures.append(RecipeMetricsHook(programs.recipe, loop.hist_interval))
    rows: list[RowHook] = []
    if options.predictors is not None:
        rows.append(PredictorRowHook(options.predictors))
    if options.telemetry is not None:
        rows.append(TelemetryRowHook(options.telemetry, programs.telemetry_names))
    if extras.lr_schedule is not None:
        rows.append(LrHook(extras.lr_schedule))
    evals = [] if extras.eval_fn is None else [EvalHook(extras.eval_fn, loop.eval_interval)]
    return measures, rows, evals


def _step_hooks(hooks: Sequence[Hook], loop: LoopOptions, start: int) -> list[Hook]:
    """``hooks``, then a progress bar and the checkpoints (written by process 0 only)."""
    out = list(hooks)
    if loop.progress if loop.progress is not None else sys.stderr.isatty():
        out.append(ProgressHook.for_run(loop.steps, start, loop.desc))
    if loop.checkpoint_dir is not None and is_main():
        out.append(CheckpointHook(loop.checkpoint_dir, loop.checkpoint_interval))
    return out


def _measure(
    hooks: list[MeasureHook], step: int, state: Any, batch: Any, clock: _Clock
) -> list[tuple[MeasureHook, dict[str, Any]]]:
    """What the due measurements read from the state a call starts from."""
    out = []
    with clock("probe_s"):
        for hook in hooks:
            if hook.due(step):
                out.append((hook, hook.measure(step, state, batch)))
                clock.sync()
    return out


def _before_step(hooks: list[Hook], step: int, state: Any, batch: Any, clock: _Clock) -> None:
    with clock("hooks_s"):  # a hook that reads the state a step starts from
        for hook in hooks:
            before = getattr(hook, "before_step", None)
            if before is not None:
                before(step, state, batch)


def _call(
    run: _Prepared, state: Any, batch: Any, raw: list[Any], clock: _Clock
) -> tuple[Any, list[dict[str, Any]], float]:
    """One compiled call over the batches ``raw``: the state after it, the host metrics of
    each step and the call's seconds."""
    n, ts = len(raw), time.perf_counter()
    if run.chunk == 1:
        state, metrics = run.programs.step(state, batch)
        fetched = [jax.device_get(metrics)]
    else:
        with clock("data_s"):
            stacked = _stack(raw + raw[-1:] * (run.chunk - n))  # padding is not run
        state, metrics = run.programs.chunk(state, stacked, jnp.int32(n))
        stacked_metrics = jax.device_get(metrics)
        fetched = [jax.tree_util.tree_map(lambda x, i=i: x[i], stacked_metrics) for i in range(n)]
    clock.sync()
    elapsed = time.perf_counter() - ts
    clock.call(elapsed, n)
    return state, fetched, elapsed


def _step_record(
    m: dict[str, Any],
    step: int,
    params: Any,
    loss_weight: float,
    rows: list[RowHook],
    agg: Aggregates,
) -> dict[str, Any]:
    """Step ``step``'s record (1-based) from its fetched metrics and the due row hooks."""
    sources = {h.source: m.pop(h.source, None) for h in rows if h.source is not None}
    rec = _record(m, step, params, loss_weight)
    for hook in rows:
        if hook.due(step - 1):
            rec.update(hook.row(step - 1, sources.get(hook.source or ""), agg))
    return rec


def _fold(
    rec: dict[str, Any], agg: Aggregates, measured: list[tuple[MeasureHook, dict[str, Any]]]
) -> Aggregates:
    for hook, fields in measured:
        rec.update(fields)
        agg = hook.fold(agg)
    return agg


def _evaluate(
    hooks: list[EvalHook],
    step: int,
    last: bool,
    state: Any,
    rec: dict[str, Any],
    agg: Aggregates,
    clock: _Clock,
) -> Aggregates:
    for hook in hooks:
        if hook.due(step) or last:
            assert state is not None, "an eval step ends its chunk (_chunk_len)"
            with clock("eval_s"):
                ev = hook.evaluate(state.params)
                clock.sync()
            rec.update(ev)
            agg = hook.fold(agg, step, ev)
    return agg


def _on_step(hooks: list[Hook], end: StepEnd, clock: _Clock) -> None:
    with clock("hooks_s"):
        for hook in hooks:
            hook.on_step(end)


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """A run's initial state, mesh, steps per call, jitted programs and batch source."""

    state: Any
    mesh: Any
    chunk: int
    programs: _Programs
    batches: Any

    def shard(self, batch: Any) -> Any:
        """``batch`` split over the data-parallel mesh (unchanged without one)."""
        return batch if self.mesh is None else shard_batch(batch, self.mesh)


def _prepare(
    loss_fn: Callable,
    params: Any,
    optimizer: Any,
    batches: Any,
    options: StepOptions,
    loop: LoopOptions,
    extras: LoopExtras,
) -> _Prepared:
    """The step built (its values include ``loop.loss_weight``) and its programs, shared under
    ``extras.program_key``; nothing is compiled here."""
    vals = dict(extras.values or {})
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
    probe_fn, shadow_fn = extras.probe_loss_fn, extras.shadow_loss_fn

    def make_programs() -> _Programs:
        return _programs(step_fn, loss_fn, probe_fn, shadow_fn, options, loop, chunk)

    if extras.program_key is None:
        programs = make_programs()
    else:
        programs = shared_programs((extras.program_key, chunk, halt), make_programs)
    return _Prepared(state, mesh, chunk, programs, batches)


def compile_programs(
    loss_fn: Callable,
    params: Any,
    optimizer: Any,
    batches: Callable[[int], Iterator[Any]],
    *,
    options: StepOptions,
    loop: LoopOptions,
    extras: LoopExtras,
) -> Any:
    """Compile the programs :func:`train_loop` runs with these arguments (and
    ``extras.program_key``: step or chunk, probes), so that run finds them compiled; returns
    its initial params (for compiling its evaluation). XLA compiles outside the Python lock:
    call it in a thread to compile one run while another trains. Nothing for a data-parallel
    run (None)."""
    run = _prepare(loss_fn, params, optimizer, batches, options, loop, extras)
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
    """The jitted functions of a run (see :func:`_programs`; ``jax.jit`` wrappers, typed Any
    for their ``lower``): the step or the chunk, and the probes (None when not run)."""

    step: Any
    chunk: Any
    probe: Any
    recipe: Any
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
    if loop.hist_interval and options.recipe is not None and measures(options.recipe.recipe):
        recipe, pol = options.recipe, options.policy

        def recipe_probe_fn(state: TrainState, batch: Any) -> Any:
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

        def body(carry: tuple[Any, jax.Array], xs: tuple[jax.Array, Any]) -> tuple[Any, Any]:
            st, stop = carry
            i, batch = xs

            def active(st: Any) -> tuple[Any, Any]:
                return step_jit(st, batch)

            def idle(st: Any) -> tuple[Any, Any]:
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

    def run(self, chunk: int) -> contextlib.AbstractContextManager[Any]:
        """The context of the whole loop (the compile meter), given the steps per call."""
        if self.timings is None:
            return contextlib.nullcontext()
        self.timings.chunk_steps = chunk
        return self.timings.compile


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
