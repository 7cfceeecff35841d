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
import functools
from collections.abc import Callable
from typing import Any

from precisionlab._text import table
from precisionlab.bench import _interval
from precisionlab.bench._interval import MODELS
from precisionlab.train import StepOptions
from precisionlab.train._predictors import Predictors, predictor_row

HELP = "train-step time with the divergence predictors every N steps and every step vs without"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _interval.add_interval_arguments(parser, models=MODELS, what="predictors")


def _record(step: Callable, fetched: Any, step_number: int) -> None:
    predictor_row(fetched, step_number)


def measure_model(
    model_name: str, batch: int = 128, interval: int = 10, steps: int = 20, repeats: int = 5
) -> dict[str, Any]:
    """ms/step of (a), (b), (c) for one model and the ratios b/a and c/a."""
    model, params, batches, loss_fn = _interval.built_in(model_name, batch, steps)
    layers = tuple((n, model.layer_params(n)) for n in model.layer_names())

    def runner(predictors: Predictors | None) -> Callable[[], Any]:
        if predictors is not None:
            predictors = dataclasses.replace(predictors, layers=layers)
        opts = StepOptions(predictors=predictors)
        return _interval.step_runner(
            loss_fn, params, batches, opts, "predictors", predictors, _record
        )

    runs = {
        "a-plain": runner(None),
        "b-interval": runner(Predictors(interval=interval)),
        "c-every-step": runner(Predictors(interval=1)),
    }
    return _interval.model_result(model_name, model, params, runs, steps, repeats)


#: Every model's :func:`measure_model`, with the settings and the machine:
#: ``measure(models=MODELS, batch=128, interval=10, steps=20, repeats=5)``.
measure = functools.partial(_interval.measure, measure_model)


def render(result: dict[str, Any]) -> str:
    head = (
        f"divergence predictors every {result['interval']} steps, batch {result['batch']}, "
        f"{result['backend']}, best of {result['repeats']} x {result['steps_per_round']} steps"
    )
    variants = ("a-plain", "b-interval", "c-every-step")
    rows = _interval.model_rows(result, variants, ("b/a", "c/a"))
    cols = ["model", "(a) plain", "(b) every N", "(c) every step", "b/a", "c/a"]
    lines = [head, "ms per step; model (thousands of params)"]
    return "\n".join([*lines, table(rows, cols, align="lrrrrr")])


def run(args: argparse.Namespace) -> int:
    return _interval.run_bench(args, measure, render)
