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
from precisionlab.train.telemetry import DEFAULT_TARGETS, Telemetry, telemetry_rows

HELP = "train-step time with numerics telemetry every N steps vs without (ratio, <= 1.10)"

MODELS = ("mlp", "transformer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_interval_arguments(parser, models=MODELS, what="telemetry")


def _runner(
    loss_fn: Callable, params: Any, batches: list[Any], telemetry: Telemetry | None
) -> Callable[[], dict[str, jax.Array] | None]:
    opts = StepOptions(telemetry=telemetry)
    step, state, _ = build_step(loss_fn, params, optax.adam(1e-3), opts)
    jstep = jax.jit(step, donate_argnums=0)
    cell = [jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), state)]

    def run() -> dict[str, jax.Array] | None:
        s = cell[0]
        out: dict[str, jax.Array] | None = None
        for b in batches:
            due = telemetry is not None and telemetry.due(int(s.step))
            s, out = jstep(s, b)
            tel = out.pop("telemetry", None)
            if due:  # what the loop does on a telemetry step: fetch and make the rows
                assert telemetry is not None  # due says so
                names = getattr(step, "telemetry_names", {})  # filled when the step is traced
                telemetry_rows(jax.device_get(tel), names, int(s.step), telemetry.targets)
        cell[0] = s
        return out

    return run


def measure_model(
    model_name: str, batch: int = 128, interval: int = 10, steps: int = 20, repeats: int = 5
) -> dict[str, Any]:
    """ms/step of (a), (b), (c), (d) for one model and the ratios b/a, c/a and d/a."""
    if model_name not in MODELS:
        raise UsageError(f"--model must be one of {', '.join(MODELS)}, got {model_name!r}")
    data = make_data("teacher" if model_name == "mlp" else "markov")
    model = make_model(model_name, **data.model_kwargs())
    params = model.init(jax.random.PRNGKey(0))
    batches = [jax.device_put(data.batch(i, batch)) for i in range(steps)]
    loss_fn = model.loss_fn("float32")
    runs = {
        "a-plain": _runner(loss_fn, params, batches, None),
        "b-telemetry": _runner(loss_fn, params, batches, Telemetry(interval=interval)),
        "c-no-targets": _runner(loss_fn, params, batches, Telemetry(interval=interval, targets=())),
        "d-matmuls-only": _runner(
            loss_fn, params, batches, Telemetry(interval=interval, ops=False)
        ),
    }
    times = time_interleaved(runs, repeats=repeats, warmup=1)
    ms = {k: 1e3 * t.best / steps for k, t in times.items()}
    a = ms["a-plain"]
    return {
        "model": model_name,
        "params": model.param_count(params),
        "ms_per_step": ms,
        "ratios": {
            "b/a": ms["b-telemetry"] / a,
            "c/a": ms["c-no-targets"] / a,
            "d/a": ms["d-matmuls-only"] / a,
        },
    }


def measure(
    models: tuple[str, ...] = MODELS,
    batch: int = 128,
    interval: int = 10,
    steps: int = 20,
    repeats: int = 5,
) -> dict[str, Any]:
    """Every model's :func:`measure_model`, with the target verdict and the machine."""
    results = [measure_model(m, batch, interval, steps, repeats) for m in models]
    return {
        "batch": batch,
        "interval": interval,
        "targets": list(DEFAULT_TARGETS),
        "steps_per_round": steps,
        "repeats": repeats,
        "models": results,
        "target_met": {r["model"]: r["ratios"]["b/a"] <= 1.10 for r in results},
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "jax": jax.__version__,
        "cpu_count": os.cpu_count(),
    }


def render(result: dict[str, Any]) -> str:
    head = (
        f"telemetry every {result['interval']} steps (targets {', '.join(result['targets'])}), "
        f"batch {result['batch']}, {result['backend']}, best of {result['repeats']} x "
        f"{result['steps_per_round']} steps"
    )
    rows = []
    for r in result["models"]:
        ms = r["ms_per_step"]
        rows.append([
            f"{r['model']} ({r['params'] / 1e3:.0f}k)", f"{ms['a-plain']:.3f}",
            f"{ms['b-telemetry']:.3f}", f"{ms['c-no-targets']:.3f}",
            f"{ms['d-matmuls-only']:.3f}", f"{r['ratios']['b/a']:.3f}",
            f"{r['ratios']['c/a']:.3f}", f"{r['ratios']['d/a']:.3f}",
            "met" if result["target_met"][r["model"]] else "NOT met",
        ])  # fmt: skip
    cols = ["model", "(a) plain", "(b) all", "(c) no targets", "(d) matmuls", "b/a", "c/a",
            "d/a", "target"]  # fmt: skip
    lines = [head, "ms per step; model (thousands of params); target: b/a <= 1.10"]
    return "\n".join([*lines, table(rows, cols, align="lrrrrrrrl")])


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
