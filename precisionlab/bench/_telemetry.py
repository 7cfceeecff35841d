"""``precisionlab bench telemetry``: the cost of numerics telemetry every N steps, in one run.

For the default MLP and transformer (float32 step, Adam), the step time of

  (a) the plain train step;
  (b) the same step with telemetry every ``--interval`` steps (default 10) for the default
      targets (fp16, bf16, e4m3:tensor): every matmul's operands, output and cotangent, every
      other operation's output and cotangent, and every param, gradient and optimizer-state
      leaf, plus the host-side rows the loop writes;
  (c) as (b) without targets (the base statistics only: amax, smallest nonzero, moments, zeros),
      which says how much of the cost the what-if targets take;
  (d) as (b) watching the matmuls and the state only (``ops = false``), which says how much of
      the cost watching every other operation (GELU's x**3, softmax's exp, ...) takes.

Variants are timed interleaved, one chunk of steps each per round, best of ``--repeats``
rounds. The target: b/a <= 1.10.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

from precisionlab._text import table
from precisionlab.bench import _interval
from precisionlab.bench._interval import MODELS
from precisionlab.train import StepOptions
from precisionlab.train._telemetry import DEFAULT_TARGETS, Telemetry, telemetry_rows

HELP = "train-step time with numerics telemetry every N steps vs without (ratio, <= 1.10)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _interval.add_interval_arguments(parser, models=MODELS, what="telemetry")


def measure_model(
    model_name: str, batch: int = 128, interval: int = 10, steps: int = 20, repeats: int = 5
) -> dict[str, Any]:
    """ms/step of (a), (b), (c), (d) for one model and the ratios b/a, c/a and d/a."""
    model, params, batches, loss_fn = _interval.built_in(model_name, batch, steps)

    def runner(telemetry: Telemetry | None) -> Callable[[], Any]:
        def record(step: Any, fetched: Any, step_number: int) -> None:
            assert telemetry is not None  # only called on a due step
            telemetry_rows(fetched, step.telemetry_names, step_number, telemetry.targets)

        opts = StepOptions(telemetry=telemetry)
        return _interval.step_runner(loss_fn, params, batches, opts, "telemetry", telemetry, record)

    runs = {
        "a-plain": runner(None),
        "b-telemetry": runner(Telemetry(interval=interval)),
        "c-no-targets": runner(Telemetry(interval=interval, targets=())),
        "d-matmuls-only": runner(Telemetry(interval=interval, ops=False)),
    }
    return _interval.model_result(model_name, model, params, runs, steps, repeats)


def _target_met(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The target verdict per model: b/a <= 1.10."""
    return {"target_met": {r["model"]: r["ratios"]["b/a"] <= 1.10 for r in results}}


#: Every model's :func:`measure_model`, with the default targets, the target verdict and the
#: machine: ``measure(models=MODELS, batch=128, interval=10, steps=20, repeats=5)``.
measure = functools.partial(
    _interval.measure,
    measure_model,
    settings={"targets": list(DEFAULT_TARGETS)},
    verdict=_target_met,
)


def render(result: dict[str, Any]) -> str:
    head = (
        f"telemetry every {result['interval']} steps (targets {', '.join(result['targets'])}), "
        f"batch {result['batch']}, {result['backend']}, best of {result['repeats']} x "
        f"{result['steps_per_round']} steps"
    )
    variants = ("a-plain", "b-telemetry", "c-no-targets", "d-matmuls-only")
    rows = _interval.model_rows(result, variants, ("b/a", "c/a", "d/a"))
    for row, r in zip(rows, result["models"], strict=True):
        row.append("met" if result["target_met"][r["model"]] else "NOT met")
    cols = ["model", "(a) plain", "(b) all", "(c) no targets", "(d) matmuls", "b/a", "c/a",
            "d/a", "target"]  # fmt: skip
    lines = [head, "ms per step; model (thousands of params); target: b/a <= 1.10"]
    return "\n".join([*lines, table(rows, cols, align="lrrrrrrrl")])


def run(args: argparse.Namespace) -> int:
    return _interval.run_bench(args, measure, render)
