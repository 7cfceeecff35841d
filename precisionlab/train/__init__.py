"""Training loop, built-in models and data for mixed-precision experiments.

API summary (stable; the experiment runner and memory accounting code against it)
---------------------------------------------------------------------------------
High level (one call per run)::

    from precisionlab.train import TrainConfig, train
    cfg = TrainConfig(model="mlp", data="teacher", optimizer="adam", lr=1e-3,
                      policy="p=f32,c=f16,o=f32", loss_scale="dynamic", steps=500, seed=0,
                      batch_size=128, eval_interval=100, eval_batches=8, loss_weight=1.0)
    result = train(cfg, callback=print, checkpoint_dir="run/ckpt", resume=True)
    result.eval_metric, result.skipped_steps, result.diverged, result.summary()

- ``TrainConfig`` (frozen dataclass of plain values; ``TrainConfig.from_dict(table, where)``
  raises ValueError naming ``where.key`` for unknown keys / bad values; ``.to_dict()``). It is
  validated once, when made, against its field table ``TRAIN_FIELDS`` (types, defaults, allowed
  values, ranges: lr and loss_weight finite in float32, steps within the int32 step counter,
  batch_size <= 2**24, ``optimizer_kwargs`` per optimizer), and its policy, loss scale and
  storage dtypes are parsed then into ``config.precision`` (typed objects; nothing below parses
  a string again). ``loss_weight`` (default 1.0) multiplies the training loss before
  differentiation, as a loss averaged over 1/loss_weight times more tokens would; recorded
  losses (per-step ``loss``, ``final_loss``) stay the plain loss; evaluation uses the plain loss.
- ``train(config, *, callback=None, checkpoint_dir=None, resume=False, quiet=False, hooks=())
  -> TrainResult``; ``build(config) -> TrainSetup`` (the typed pieces: data, model, optimizer,
  schedule, params, loss_fn, eval batches, ``StepOptions``, ``LoopOptions``).
  ``callback(metrics: dict)`` is called once per step with plain Python values: ``step`` (1-based
  count of steps done), ``loss``, ``grad_norm`` (global norm of the unscaled gradient, float32),
  ``loss_scale`` (scale used in this step), ``skipped`` (bool), ``skip_reason`` ("",
  "nonfinite_loss" (the forward overflowed) or "nonfinite_grads" (the backward did)),
  ``nonfinite_leaves`` (list of key paths, only with ``report_leaves``), ``underflow_fraction``
  (fraction of the compute-dtype gradient elements that are zero or subnormal),
  ``nonfinite_fraction`` (those that are inf/NaN), ``lr`` (the rate applied: optax counts applied
  updates only, so skipped steps do not advance it), ``metric`` (train accuracy of the batch),
  ``diverged`` (bool, sticky), ``step_time_s``; at eval steps also ``eval_loss``, ``eval_metric``;
  at histogram steps ``grad_hist`` / ``act_hist`` (dicts: ``edges`` (log2 bin edges), ``counts``,
  ``zeros``, ``nonfinite``; the gradient histogram is of the SCALED gradient as the compute dtype
  holds it, i.e. what the format must represent); at shadow steps ``shadow_cosine`` and
  ``shadow_underflow_lost`` (fraction of elements nonzero in the fp32 gradient and zero in the
  compute-dtype gradient); with a recipe, at histogram steps ``recipe_<group>_<stat>`` (group
  ``x`` activations, ``w`` weights, ``g`` output gradients; stat ``saturated``, ``underflow``,
  ``sqnr_db``, ``log2_scale_min``, ``log2_scale_max``, see
  :mod:`precisionlab.train._recipe_metrics`).
- ``TrainConfig.recipe``: a low-precision matmul recipe (FP8, MX, NVFP4) for every matmul of
  the model: a name (``"mxfp8"``) or a table ``{name = "mxfp8", scale_rule = "floor",
  exclude = [-1]}`` (the recipe's fields; ``include`` / ``exclude`` pick matmuls by position,
  name or pattern), parsed into ``config.precision.recipe`` (a ``TrainRecipe``); block
  recipes pad with zeros unless ``pad = false``. The step runs the loss under
  ``precisionlab.recipes.apply``; delayed scaling's state is ``TrainState.recipe_state``
  (checkpointed, resumed bitwise; unchanged by a skipped step; observations combined with a
  max over micro-batches and devices). ``StepOptions(recipe=TrainRecipe(...))`` and
  ``build_step(..., example_batch=batch)`` (stateful recipes) at the low level.
  ``resume=True`` continues from the newest checkpoint in ``checkpoint_dir`` (bitwise the same as
  an uninterrupted run; starts fresh if there is none).
- ``TrainResult``: state, steps_done, final_loss, eval_loss, eval_metric, evals, skipped_steps,
  diverged, divergence_step, min_loss_scale, max_loss_scale, mean_underflow_fraction,
  wall_time_s, metrics, recipe_metrics (means over the histogram steps, or None);
  ``.summary()`` is JSON-able.

Valid names (for config validation): ``MODELS``, ``DATASETS``, ``OPTIMIZERS``, ``SCHEDULES``,
``UPDATE_ROUNDINGS``, ``DIVERGENCE_ACTIONS``, ``precisionlab.mixed.LOSS_SCALE_KINDS``.

Builders:

- ``make_data(name, **kw) -> Dataset``: ``.batch(step, batch_size, seed=, split="train")``
  is a pure function of its arguments (numpy arrays); ``.model_kwargs()`` gives the sizes a model
  needs; ``.chance`` the chance-level metric. Batches: classification ``{"x": f32[B, D],
  "y": i32[B]}``, language ``{"tokens": i32[B, T + 1]}``.
- ``make_model(name, **kw) -> Model`` with ``.init(key) -> params`` (float32 pytree),
  ``.apply(params, inputs, policy=None, capture=False)`` (logits, plus a dict of activations with
  ``capture``), ``.loss_fn(policy) -> loss_fn(params, batch) -> (loss, aux)`` where aux holds
  ``metric`` (and ``activations`` when built with ``capture=True``),
  ``.activation_shapes(batch_size, policy=None) -> dict[str, jax.ShapeDtypeStruct]`` (the
  activations the backward pass keeps, per block), ``.param_shapes()`` (params as
  ShapeDtypeStructs, nothing drawn), ``.param_count(params)``. ``init`` draws on the host with
  numpy (deterministic in the key, no compilation).
- ``make_optimizer(name, lr, *, schedule="constant", steps=None, warmup_steps=0,
  weight_decay=0.0, grad_clip=None, **kw) -> optax.GradientTransformation``.
- ``precisionlab.mixed.parse_loss_scale(spec, **kw)``, ``precisionlab.mixed.get_policy(spec)``,
  ``precisionlab.mixed.Storage(params=None, grads="float32", opt_state="float32",
  update="nearest")``.

Low level (any user model):

- ``build_step(loss_fn, params, optimizer, options=StepOptions(...)) -> TrainStep(fn, state,
  mesh)``: ``StepOptions`` (frozen: ``policy`` a Policy, ``loss_scale`` a LossScale, ``storage``,
  ``microbatches``, ``seed``, ``skip_nonfinite``, ``skip`` "cond" | "select", ``data_parallel``,
  ``allreduce_dtype``, ``zero_stage`` 0-3, ``report_leaves``;
  ``parse_step_options(policy="p=f32,c=bf16,o=f32",
  loss_scale="dynamic", ...)`` takes spec strings). ``fn(state, batch) -> (state, metrics)`` is
  a pure, UN-jitted function (wrap it in ``jax.jit``, e.g. ``jax.jit(fn, donate_argnums=0)``;
  ``jax.jit(fn).lower(state, batch).compile().memory_analysis()`` for memory accounting);
  ``state`` is a ``TrainState`` NamedTuple (step, params, opt_state, loss_scale,
  storage_state, rng); ``mesh`` the data-parallel mesh (shard batches with
  ``train.parallel.shard_batch``, place the state with ``train.parallel.place_state(state,
  mesh, zero_stage)``) or None. ``loss_fn(params, batch)`` receives params already
  cast to the compute dtype and returns a scalar loss or ``(loss, aux)``.
  ``make_train_step(loss_fn, params, optimizer, **step_options) -> (fn, state)`` is the same
  with the options as keywords.
- ``train_loop(loss_fn, params, optimizer, batches, *, loop, options=None, extras=None,
  hooks=()) -> TrainResult`` runs the jitted step over an iterable of batches with the same
  metrics, checkpoints and divergence detection as ``train``; ``loop`` is a ``LoopOptions``
  (steps, eval/checkpoint/hist/shadow intervals, divergence_k, divergence_action, loss_weight,
  checkpoint_dir, resume, progress), ``extras`` a ``LoopExtras`` (eval_fn, probe and shadow
  losses, lr_schedule, values, program_key, timings). What the loop measures every N steps
  is a hook with ``due(step)`` (:mod:`precisionlab.train._record_hooks`: probes, recipe
  metrics, telemetry, predictors, lr, evaluation). The run's totals are an ``Aggregates``
  value (pure ``update``); after each step every ``Hook`` (``on_step(StepEnd)``,
  ``close()``) runs: ``CallbackHook`` (a callback), ``ProgressHook``, ``CheckpointHook``.
- ``save_checkpoint(dir, state, *, step, extra)`` / ``load_checkpoint(dir, template)`` /
  ``latest_checkpoint(dir)``: atomic, bitwise; ``meta.json`` strict JSON (see
  :mod:`precisionlab._io`).
- Meters: ``underflow_fraction(tree, dtype)``, ``nonfinite_fraction(tree)``,
  ``log2_histogram(tree)``,
  ``shadow_stats(grads, grads_fp32)``.
- Divergence forecast: ``StepOptions(predictors=Predictors(interval=10, layers=...))`` adds
  ``metrics["predictors"]`` (per-layer signals inside ``jit``, see
  :mod:`precisionlab.train._predictors`), kept by the loop as ``record["predictors"]`` on the
  due steps; ``PredictorHook(callback)`` hands them on; ``Forecaster`` (the frozen rules of
  :mod:`precisionlab.train._forecast`) turns them into an ``Alarm``, ``ForecastHook`` prints it
  during training (``[train.predictors] live = true``).
"""

from precisionlab.train._aggregates import Aggregates
from precisionlab.train._checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from precisionlab.train._compose import TrainSetup, build, train
from precisionlab.train._config import (
    DIVERGENCE_ACTIONS,
    UPDATE_ROUNDINGS,
    TrainConfig,
    TrainResult,
)
from precisionlab.train._data import DATASETS, Dataset, make_data
from precisionlab.train._evaluation import evaluate, make_eval_fn
from precisionlab.train._forecast import Alarm, Forecaster, ForecastHook
from precisionlab.train._hooks import CallbackHook, CheckpointHook, Hook, ProgressHook, StepEnd
from precisionlab.train._loop import LoopExtras, LoopOptions, train_loop
from precisionlab.train._meters import (
    log2_histogram,
    nonfinite_fraction,
    shadow_stats,
    underflow_fraction,
)
from precisionlab.train._models import MODELS, Model, make_model
from precisionlab.train._optim import OPTIMIZERS, SCHEDULES, make_optimizer
from precisionlab.train._predictors import PredictorHook, Predictors
from precisionlab.train._specs import make_train_step, parse_step_options
from precisionlab.train._step import StepOptions, TrainState, TrainStep, build_step

__all__ = [
    "DATASETS",
    "DIVERGENCE_ACTIONS",
    "MODELS",
    "OPTIMIZERS",
    "SCHEDULES",
    "UPDATE_ROUNDINGS",
    "Aggregates",
    "Alarm",
    "CallbackHook",
    "CheckpointHook",
    "Dataset",
    "ForecastHook",
    "Forecaster",
    "Hook",
    "LoopExtras",
    "LoopOptions",
    "Model",
    "PredictorHook",
    "Predictors",
    "ProgressHook",
    "StepEnd",
    "StepOptions",
    "TrainConfig",
    "TrainResult",
    "TrainSetup",
    "TrainState",
    "TrainStep",
    "build",
    "build_step",
    "evaluate",
    "latest_checkpoint",
    "load_checkpoint",
    "log2_histogram",
    "make_data",
    "make_eval_fn",
    "make_model",
    "make_optimizer",
    "make_train_step",
    "nonfinite_fraction",
    "parse_step_options",
    "save_checkpoint",
    "shadow_stats",
    "train",
    "train_loop",
    "underflow_fraction",
]
