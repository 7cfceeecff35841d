"""``precisionlab bench predictors``: the cost of the divergence predictors, in one run.

For the default MLP and transformer (float32 step, Adam), the step time of

  (a) the plain train step;
  (b) the same step with the predictors every ``--interval`` steps (default 10; the suite
      records every 10 steps), plus the host-side rows the loop makes;
  (c) the predictors on every step: the cost of one recording step (c/a - 1 is what a due
      step adds, b/a - 1 its share over the interval).

Variants are timed interleaved, one chunk of steps each per round, best of ``--repeats``
rounds. No target: the figures are reported (``docs/benchmarks/forecast.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from precisionlab import _io
from precisionlab._text import UsageError, table
from precisionlab.bench._timing import add_interval_arguments, time_interleaved
from precisionlab.train import StepOptions, build_step, make_data, make_model
from precisionlab.train._predictors import Predictors, predictor_row

HELP = "train-step time with the divergence predictors every N steps and every step vs without"

MODELS = ("mlp", "transformer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_interval_arguments(parser, models=MODELS, what="predictors")


def _runner(
    loss_fn: Callable, params: Any, batches: Any, layers: Any, predictors: Predictors | None
) -> Callable[[], Any]:
    if predictors is not None:
        predictors = dataclasses.replace(predictors, layers=layers)
    step, state, _ = build_step(
        loss_fn, params, optax.adam(1e-3), StepOptions(predictors=predictors)
    )
    jstep = jax.jit(step, donate_argnums=0)
    cell = [jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), state)]

    def run() -> Any:
        s, out = cell[0], None
        for b in batches:
            due = predictors is not None and predictors.due(int(s.step))
            s, out = jstep(s, b)
            pred = out.pop("predictors", None)
            if due:  # what the loop does on a recording step: fetch and make the row
                predictor_row(jax.device_get(pred), int(s.step))
        cell[0] = s
        return out

    return run


def measure_model(
    model_name: str, batch: int = 128, interval: int = 10, steps: int = 20, repeats: int = 5
) -> dict[str, Any]:
    """ms/step of (a), (b), (c) for one model and the ratios b/a and c/a."""
    if model_name not in MODELS:
        raise UsageError(f"--model must be one of {', '.join(MODELS)}, got {model_name!r}")
    data = make_data("teacher" if model_name == "mlp" else "markov")
    model = make_model(model_name, **data.model_kwargs())
    params = model.init(jax.random.PRNGKey(0))
    batches = [jax.device_put(data.batch(i, batch)) for i in range(steps)]
    loss_fn = model.loss_fn("float32")
    layers = tuple((n, model.layer_params(n)) for n in model.layer_names())
    runs = {
        "a-plain": _runner(loss_fn, params, batches, layers, None),
        "b-interval": _runner(loss_fn, params, batches, layers, Predictors(interval=interval)),
        "c-every-step": _runner(loss_fn, params, batches, layers, Predictors(interval=1)),
    }
    times = time_interleaved(runs, repeats=repeats, warmup=1)
    ms = {k: 1e3 * t.best / steps for k, t in times.items()}
    a = ms["a-plain"]
    return {
        "model": model_name,
        "params": model.param_count(params),
        "ms_per_step": ms,
        "ratios": {"b/a": ms["b-interval"] / a, "c/a": ms["c-every-step"] / a},
    }


def measure(
    models: tuple[str, ...] = MODELS,
    batch: int = 128,
    interval: int = 10,
    steps: int = 20,
    repeats: int = 5,
) -> dict[str, Any]:
    """Every model's :func:`measure_model`, with the machine."""
    return {
        "batch": batch,
        "interval": interval,
        "steps_per_round": steps,
        "repeats": repeats,
        "models": [measure_model(m, batch, interval, steps, repeats) for m in models],
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "jax": jax.__version__,
        "cpu_count": os.cpu_count(),
    }


def render(result: dict[str, Any]) -> str:
    head = (
        f"divergence predictors every {result['interval']} steps, batch {result['batch']}, "
        f"{result['backend']}, best of {result['repeats']} x {result['steps_per_round']} steps"
    )
    rows = []
    for r in result["models"]:
        ms = r["ms_per_step"]
        rows.append([
            f"{r['model']} ({r['params'] / 1e3:.0f}k)", f"{ms['a-plain']:.3f}",
            f"{ms['b-interval']:.3f}", f"{ms['c-every-step']:.3f}",
            f"{r['ratios']['b/a']:.3f}", f"{r['ratios']['c/a']:.3f}",
        ])  # fmt: skip
    cols = ["model", "(a) plain", "(b) every N", "(c) every step", "b/a", "c/a"]
    lines = [head, "ms per step; model (thousands of params)"]
    return "\n".join([*lines, table(rows, cols, align="lrrrrr")])


#: Largest batch: the transformer's activations at 65,536 sequences take gigabytes already.
_BATCH_MAX = 1 << 16


def run(args: argparse.Namespace) -> int:
    models = tuple(dict.fromkeys(args.model)) if args.model else MODELS
    if args.batch > _BATCH_MAX:
        raise UsageError(f"--batch must be at most {_BATCH_MAX}, got {args.batch}")
    result = measure(models, args.batch, args.interval, args.steps, args.repeats)
    if args.out is not None:
        _io.write_json(args.out, result)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0
