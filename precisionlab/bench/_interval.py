"""What the benches of an instrument run every N steps share (``precisionlab bench predictors``,
``precisionlab bench telemetry``): their options, the built-in model they time, a train step
with the instrument that does on a due step what the training loop does, and the command.

Each bench times the plain step (a) against the step with its instrument; see its module.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax

from precisionlab._text import UsageError
from precisionlab.bench._output import add_output_arguments, machine, print_result
from precisionlab.bench._timing import positive_int, repeats_int, time_interleaved
from precisionlab.train import StepOptions, build_step, make_data, make_model
from precisionlab.train._models import Model

__all__ = [
    "BATCH_MAX",
    "MODELS",
    "Instrument",
    "add_interval_arguments",
    "built_in",
    "measure",
    "model_result",
    "model_rows",
    "ms_per_step",
    "run_bench",
    "step_runner",
]

#: The built-in models these benches time.
MODELS = ("mlp", "transformer")
#: Largest batch: the transformer's activations at 65,536 sequences take gigabytes already.
BATCH_MAX = 1 << 16


class Instrument(Protocol):
    """An instrument of the train step that records on some steps (``Telemetry``,
    ``Predictors``)."""

    def due(self, step: int) -> bool:
        """Whether the step numbered ``step`` records."""
        ...


def add_interval_arguments(
    parser: argparse.ArgumentParser, *, models: tuple[str, ...], what: str
) -> None:
    """The options of a bench that times a built-in model's train step with an instrument
    (``what``: its name in the help) every N steps against the plain step: ``--model``
    (repeatable, ``models``), ``--batch``, ``--interval``, ``--steps``, ``--repeats``, ``--json``,
    ``--out``."""
    parser.add_argument(
        "--model", action="append", choices=models, default=None,
        help=f"built-in model (repeatable; default: {' and '.join(models)})",
    )  # fmt: skip
    parser.add_argument("--batch", type=positive_int, default=128, help="batch size (default 128)")
    parser.add_argument(
        "--interval", type=positive_int, default=10, help=f"{what} every N steps (default 10)"
    )
    parser.add_argument(
        "--steps", type=repeats_int, default=20, help="steps per timed chunk (default 20)"
    )
    parser.add_argument(
        "--repeats", type=repeats_int, default=5, help="timed rounds, best kept (default 5)"
    )
    add_output_arguments(parser)


def built_in(model_name: str, batch: int, steps: int) -> tuple[Model, Any, list[Any], Callable]:
    """The built-in model ``model_name`` (one of :data:`MODELS`) on its default dataset
    (``teacher`` for the MLP, ``markov`` for the transformer): the model, its parameters
    (key 0), ``steps`` batches of ``batch`` on the device, and its float32 loss.

    Raises:
      UsageError: if ``model_name`` is not one of :data:`MODELS`.
    """
    if model_name not in MODELS:
        raise UsageError(f"--model must be one of {', '.join(MODELS)}, got {model_name!r}")
    data = make_data("teacher" if model_name == "mlp" else "markov")
    model = make_model(model_name, **data.model_kwargs())
    params = model.init(jax.random.PRNGKey(0))
    batches = [jax.device_put(data.batch(i, batch)) for i in range(steps)]
    return model, params, batches, model.loss_fn("float32")


def step_runner(
    loss_fn: Callable,
    params: Any,
    batches: list[Any],
    options: StepOptions,
    output: str,
    instrument: Instrument | None,
    record: Callable[[Any, Any, int], Any],
) -> Callable[[], Any]:
    """A zero-argument callable that runs the jitted train step (Adam, the state donated; a
    copy of the initial state of its own) over ``batches``. The step's ``output`` entry is
    popped from its metrics; on a step where ``instrument`` is due it is fetched to the host
    and passed to ``record(step_fn, value, step_number)``, as the training loop does."""
    step, state, _ = build_step(loss_fn, params, optax.adam(1e-3), options)
    jstep = jax.jit(step, donate_argnums=0)
    cell = [jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), state)]

    def run() -> Any:
        s, out = cell[0], None
        for b in batches:
            due = instrument is not None and instrument.due(int(s.step))
            s, out = jstep(s, b)
            value = out.pop(output, None)
            if due:  # what the loop does on a recording step: fetch and make the rows
                record(step, jax.device_get(value), int(s.step))
        cell[0] = s
        return out

    return run


def ms_per_step(runs: Mapping[str, Callable[[], Any]], steps: int, repeats: int) -> dict:
    """Milliseconds per step of each run (``steps`` steps a call), timed interleaved after one
    warm-up round, best of ``repeats`` rounds."""
    times = time_interleaved(runs, repeats=repeats, warmup=1)
    return {k: 1e3 * t.best / steps for k, t in times.items()}


def model_result(
    model_name: str,
    model: Model,
    params: Any,
    runs: Mapping[str, Callable[[], Any]],
    steps: int,
    repeats: int,
) -> dict[str, Any]:
    """One model's entry of a bench's result: the ms per step of each of ``runs`` (see
    :func:`ms_per_step`), the first the plain step ``a-...``, and the ratio of every other,
    ``b-...``, ``c-...``, to it (keys ``b/a``, ``c/a``, ...)."""
    ms = ms_per_step(runs, steps, repeats)
    plain, *others = ms
    return {
        "model": model_name,
        "params": model.param_count(params),
        "ms_per_step": ms,
        "ratios": {f"{name[0]}/a": ms[name] / ms[plain] for name in others},
    }


#: ``measure_model(model_name, batch, interval, steps, repeats)``: one model's
#: :func:`model_result`.
MeasureModel = Callable[[str, int, int, int, int], dict[str, Any]]


def measure(
    measure_model: MeasureModel,
    models: tuple[str, ...] = MODELS,
    batch: int = 128,
    interval: int = 10,
    steps: int = 20,
    repeats: int = 5,
    *,
    settings: Mapping[str, Any] | None = None,
    verdict: Callable[[list[dict[str, Any]]], Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """A bench's result: its settings (``batch``, ``interval``, then the bench's own
    ``settings``, ``steps_per_round``, ``repeats``), every model's ``measure_model`` in order,
    the bench's ``verdict`` on them, and the machine."""
    results = [measure_model(m, batch, interval, steps, repeats) for m in models]
    return {
        "batch": batch,
        "interval": interval,
        **(settings or {}),
        "steps_per_round": steps,
        "repeats": repeats,
        "models": results,
        **(verdict(results) if verdict is not None else {}),
        **machine(),
    }


def model_rows(
    result: dict[str, Any], variants: tuple[str, ...], ratios: tuple[str, ...]
) -> list[list[str]]:
    """The table rows of a bench's result, one per model: ``name (thousands of params)``, its
    ms per step under each of ``variants``, then each of its ``ratios`` (3 decimals)."""
    return [
        [
            f"{r['model']} ({r['params'] / 1e3:.0f}k)",
            *(f"{r['ms_per_step'][v]:.3f}" for v in variants),
            *(f"{r['ratios'][k]:.3f}" for k in ratios),
        ]
        for r in result["models"]
    ]


def run_bench(
    args: argparse.Namespace,
    measure: Callable[..., dict[str, Any]],
    render: Callable[[dict[str, Any]], str],
) -> int:
    """The command of an interval bench: checks ``--batch``, runs ``measure(models, batch,
    interval, steps, repeats)`` (every model of ``--model`` once, in order; default all),
    writes the JSON to ``--out`` and prints it (``--json``) or ``render``'s table."""
    models = tuple(dict.fromkeys(args.model)) if args.model else MODELS
    if args.batch > BATCH_MAX:
        raise UsageError(f"--batch must be at most {BATCH_MAX}, got {args.batch}")
    result = measure(models, args.batch, args.interval, args.steps, args.repeats)
    print_result(result, args, render)
    return 0
