"""The composition root of training: a :class:`~precisionlab.train._config.TrainConfig` built
into typed pieces (:func:`build`: model, data, optimizer, schedule, step and loop options) and
run by :func:`train` through :func:`~precisionlab.train._loop.train_loop`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import optax

from precisionlab.mixed._policy import Policy
from precisionlab.train._config import (
    TrainConfig,
    TrainResult,
)
from precisionlab.train._data import Dataset, make_data
from precisionlab.train._evaluation import make_eval_fn
from precisionlab.train._hooks import CallbackHook, Hook
from precisionlab.train._loop import LoopExtras, LoopOptions, compile_programs, train_loop
from precisionlab.train._models import Model, make_model
from precisionlab.train._optim import (
    VALUE_KWARGS,
    make_optimizer,
    make_schedule,
    optimizer_defaults,
)
from precisionlab.train._predictors import parse_predictors
from precisionlab.train._step import OptimizerFactory, StepOptions
from precisionlab.train._telemetry import parse_telemetry
from precisionlab.train._timing import LoopTimings

__all__ = [
    "VALUE_FIELDS",
    "TrainSetup",
    "build",
    "precompile",
    "program_key",
    "run_values",
    "train",
]

#: TrainConfig fields that are arguments of a run's compiled programs (``lr``, ``loss_weight``:
#: ``TrainState.values``), only make its initial state and data (``seed``), or touch no program
#: (``progress``): runs differing only in them, in a static loss scale's value and in the
#: optimizer kwargs of ``VALUE_KWARGS`` share their programs (see :func:`program_key`).
VALUE_FIELDS: tuple[str, ...] = ("lr", "loss_weight", "seed", "progress")

#: The :class:`LoopOptions` a config sets, by the same names (the rest, such as the checkpoint
#: directory and resuming, are the caller's: :func:`train`).
_LOOP_FIELDS: tuple[str, ...] = (
    "steps",
    "eval_interval",
    "checkpoint_interval",
    "divergence_k",
    "divergence_action",
    "hist_interval",
    "shadow_interval",
    "loss_weight",
    "chunk_steps",
    "deterministic",
)


@dataclasses.dataclass(frozen=True)
class TrainSetup:
    """Everything a :class:`TrainConfig` describes, built: the typed objects the loop takes.

    data, model, optimizer (optax), schedule (count -> lr), params (float32, from the seed),
    loss_fn (the model's loss under the policy), eval_batches (the same for every seed),
    options (:class:`StepOptions`), loop (:class:`LoopOptions`); values (the numbers the
    compiled programs take as arguments, :func:`run_values`), optimizer_factory (the
    optimizer built from them inside the step) and program_key (:func:`program_key`).
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
    values: dict[str, float]
    optimizer_factory: OptimizerFactory
    program_key: str

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


def run_values(config: TrainConfig) -> dict[str, float]:
    """The numbers of ``config`` its compiled step takes as arguments (besides ``loss_weight``,
    which the loop adds): ``lr`` and the optimizer kwargs named in ``VALUE_KWARGS`` that the
    optimizer takes (given, or optax's default)."""
    given = config.optimizer_kwargs
    out = {"lr": float(config.lr)}
    for name, default in optimizer_defaults(config.optimizer, VALUE_KWARGS).items():
        out[name] = float(given.get(name, default))
    return out


def program_key(config: TrainConfig) -> str:
    """What the compiled programs of ``config`` depend on, as a string: the config without its
    :data:`VALUE_FIELDS`, the values of the optimizer kwargs in ``VALUE_KWARGS`` and of a
    static loss scale (a leaf of the state). Configs with equal keys train with the same
    programs (:mod:`precisionlab.train._programs`)."""
    table = config.to_dict()
    for name in VALUE_FIELDS:
        table.pop(name)
    table["optimizer_kwargs"] = {
        k: v for k, v in config.optimizer_kwargs.items() if k not in VALUE_KWARGS
    }
    # No loss scaling is not run as a static scale of 1 (that step skips non-finite updates
    # under a lax.cond, which XLA may fuse differently): not shown bit-identical, so a program
    # of its own.
    table["loss_scale"] = type(config.precision.loss_scale).__name__
    # a recipe's value fields (Delayed's margin, an eps, NVFP4's Hadamard seed) are arguments
    # too (TrainState.values["recipe"]): the key names the recipe with them fixed
    rec = config.precision.recipe
    table["recipe"] = None if rec is None else repr(rec.structure())
    return json.dumps(table, sort_keys=True, default=repr)


def _optimizer_factory(config: TrainConfig) -> OptimizerFactory:
    """The optimizer of ``config`` with ``lr`` and ``VALUE_KWARGS`` read from ``values``."""

    def make(values: Mapping[str, Any]) -> optax.GradientTransformation:
        kwargs = {k: v for k, v in config.optimizer_kwargs.items() if k not in VALUE_KWARGS}
        kwargs.update({k: values[k] for k in VALUE_KWARGS if k in values})
        kwargs.update({k: v for k, v in config.optimizer_kwargs.items() if k not in kwargs})
        return make_optimizer(
            config.optimizer,
            values.get("lr", config.lr),
            schedule=config.schedule,
            weight_decay=config.weight_decay,
            grad_clip=config.grad_clip,
            steps=config.steps,
            warmup_steps=config.warmup_steps,
            **kwargs,
        )

    return make


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
    factory = _optimizer_factory(config)
    values = run_values(config)
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
        predictors=parse_predictors(
            config.predictors,
            config.steps,
            layers=[(n, model.layer_params(n)) for n in model.layer_names()],
            norm_format=getattr(model, "norm_format", None),
        ),
    )
    loop = LoopOptions(**{name: getattr(config, name) for name in _LOOP_FIELDS})
    return TrainSetup(
        config=config,
        data=data,
        model=model,
        optimizer=factory(values),  # type: ignore[arg-type]  # floats where traced scalars go
        schedule=make_schedule(config.lr, config.schedule, **sched),
        params=model.init(jax.random.PRNGKey(config.seed)),
        loss_fn=model.loss_fn(precision.policy),
        # The eval set is the same for every seed, so variants of an experiment are comparable.
        eval_batches=data.eval_batches(config.eval_batches, config.batch_size, seed=0),
        options=options,
        loop=loop,
        values=values,
        optimizer_factory=factory,
        program_key=program_key(config),
    )


def _loop_args(setup: TrainSetup, **extras: Any) -> dict[str, Any]:
    """The arguments of :func:`train_loop` (and :func:`compile_programs`) a setup gives, with
    ``extras`` (fields of :class:`LoopExtras`) added."""
    config, policy, model = setup.config, setup.policy, setup.model
    shadow = model.loss_fn(Policy(enforce=False)) if config.shadow else None
    return dict(
        loss_fn=setup.loss_fn,
        params=setup.params,
        optimizer=setup.optimizer_factory,
        batches=lambda start: setup.data.batches(config.batch_size, seed=config.seed, start=start),
        options=setup.options,
        loop=setup.loop,
        extras=LoopExtras(
            probe_loss_fn=model.loss_fn(policy, capture=True),
            shadow_loss_fn=shadow,
            values=setup.values,
            program_key=setup.program_key,
            **extras,
        ),
    )


def _eval_fn(setup: TrainSetup) -> Callable:
    return make_eval_fn(
        setup.loss_fn, setup.policy, setup.eval_batches, program_key=setup.program_key,
        deterministic=setup.config.deterministic,
    )  # fmt: skip


def train(
    config: TrainConfig,
    *,
    callback: Callable[[dict[str, Any]], None] | None = None,
    checkpoint_dir: Any = None,
    resume: bool = False,
    quiet: bool = False,
    hooks: Sequence[Hook] = (),
    timings: LoopTimings | None = None,
) -> TrainResult:
    """Run the training described by ``config`` (see the package docstring for the metrics).

    ``hooks`` run after each step (after ``callback``); ``quiet`` turns off the progress bar;
    ``timings`` (a :class:`~precisionlab.train._timing.LoopTimings`) receives where the loop's
    time went. Runs whose configs differ only in values (:data:`VALUE_FIELDS`) share their
    compiled programs within the process.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    if config.checkpoint_interval and checkpoint_dir is None:
        raise ValueError("checkpoint_interval > 0 needs a checkpoint_dir")
    setup = build(config)
    args = _loop_args(setup, eval_fn=_eval_fn(setup), lr_schedule=setup.schedule, timings=timings)
    args["loop"] = dataclasses.replace(
        setup.loop,
        checkpoint_dir=checkpoint_dir,
        resume=resume,
        progress=False if quiet else config.progress,
        desc=f"{config.model} {setup.policy}",
    )
    first = [] if callback is None else [CallbackHook(callback)]
    return train_loop(**args, hooks=[*first, *hooks])


def precompile(config: TrainConfig) -> None:
    """Compile the programs :func:`train` runs for ``config`` (step or chunk, probes,
    evaluation) without training, so a later ``train(config)`` in this process finds them
    compiled. XLA compiles outside the Python lock: the experiment runner calls this in a
    thread for the next run while the current one trains."""
    setup = build(config)
    params = compile_programs(**_loop_args(setup))
    if params is not None:
        evaluate: Any = _eval_fn(setup)  # a jax.jit wrapper
        evaluate.lower(params).compile()
