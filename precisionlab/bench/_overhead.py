"""``precisionlab bench overhead``: what each instrument costs on a user's model, as ratios to
the same model's float32 step, in one run.

The model is a user's, written in plain JAX as a user writes one: a pre-LayerNorm decoder-only
transformer LM (:func:`precisionlab.bench._recipes.loss_fn`; default 3 layers, d = 96, 4 heads,
vocabulary 256, 64 tokens, batch 16: about 390k parameters and 19 matmuls), trained with optax
``adamw``. Every variant is the same train step (``value_and_grad`` of the loss, the adamw
update, jitted, the state donated) with one instrument added, as the docs show it:

- ``fp32``: the plain step (the reference);
- ``telemetry``: ``telemetry.observe(loss, targets)``'s ``value_and_grad`` (statistics of
  every matmul's operands, output and output cotangent) and ``telemetry.tree_stats`` of the
  gradients, every step (targets: ``--targets``, default fp16, bf16, e4m3:tensor, e5m2);
- ``every10-skip``: the plain step and ``telemetry.every(10, step, ...)`` around the same
  statistics, timed on the steps it skips (the step counter never a multiple of 10);
- ``train-every10-skip``: the training loop's telemetry (:func:`precisionlab.train.build_step`
  with ``Telemetry(interval=10)``), on the steps it skips, against the same step without it
  (``train-fp32``);
- the recipes (``recipes.apply(loss, NAME).value_and_grad()``): FP8 (``current``,
  ``delayed``, ``mxfp8``) and 4-bit (``mxfp4``, ``nvfp4``);
- ``emulate``: ``emulate(loss, "c=bf16")`` with its default matmul model (the H100's tensor
  cores as XLA drives them), differentiated.

Steady state: each variant is compiled first, then timed in alternating rounds of ``--steps``
steps each (one call per step, as a training loop makes them), best of ``--repeats`` rounds;
the ratio of a variant is its best round over ``fp32``'s, in wall seconds (the target's
measure) and in process CPU seconds (all threads: on a shared machine it leaves out the time
other processes held the cores). ``--compile`` also measures the CPU
seconds (all threads of this process) of compiling the telemetry step against the plain one
(no persistent cache). Targets (the "any model" work): telemetry <= 2x, every(N) on skipped
steps <= 1.1x, FP8 recipes <= 2x, 4-bit <= 3x, emulate <= 10x, the telemetry step's compile
<= 2x.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from precisionlab import recipes, telemetry
from precisionlab._text import UsageError, split_list, table
from precisionlab.bench._output import add_output_arguments, print_result
from precisionlab.bench._recipes import ModelSize, add_model_arguments, loss_fn
from precisionlab.bench._timing import repeats_int
from precisionlab.emulate import emulate
from precisionlab.telemetry import parse_targets
from precisionlab.train import StepOptions, build_step
from precisionlab.train._telemetry import Telemetry

HELP = "cost of telemetry, every(N), recipes and emulate on a user's transformer LM vs fp32"

VARIANTS = (
    "fp32", "telemetry", "every10-skip", "train-fp32", "train-every10-skip", "current",
    "delayed", "mxfp8", "mxfp4", "nvfp4", "emulate",
)  # fmt: skip
#: variant -> (what it is compared with, the target ratio)
TARGETS: dict[str, tuple[str, float]] = {
    "telemetry": ("fp32", 2.0),
    "every10-skip": ("fp32", 1.1),
    "train-every10-skip": ("train-fp32", 1.1),
    "current": ("fp32", 2.0),
    "delayed": ("fp32", 2.0),
    "mxfp8": ("fp32", 2.0),
    "mxfp4": ("fp32", 3.0),
    "nvfp4": ("fp32", 3.0),
    "emulate": ("fp32", 10.0),
}
TELEMETRY_TARGETS = ("fp16", "bf16", "e4m3:tensor", "e5m2")
COMPILE_TARGET = 2.0
#: The model of the module docstring.
DEFAULT_SIZE = ModelSize(batch=16, seq=64, d_model=96, layers=3, heads=4, vocab=256)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--variants", help=f"comma-separated (default: all of {','.join(VARIANTS)})"
    )
    add_model_arguments(parser, DEFAULT_SIZE)
    parser.add_argument(
        "--steps", type=repeats_int, default=10, help="steps per timed round (default 10)"
    )
    parser.add_argument(
        "--repeats", type=repeats_int, default=5, help="timed rounds, best kept (default 5)"
    )
    parser.add_argument(
        "--compile", action="store_true",
        help="also measure the telemetry step's compile time against the plain step's",
    )  # fmt: skip
    parser.add_argument(
        "--targets", default=",".join(TELEMETRY_TARGETS),
        help="the telemetry variants' target formats, comma-separated ('' for none: moments, "
        f"extremes and counts only; default {','.join(TELEMETRY_TARGETS)})",
    )  # fmt: skip
    add_output_arguments(parser)


# --- the variants ----------------------------------------------------------------------------
StepFn = Callable[..., tuple]  # (params, batch, i) -> (loss, grads, aux)


def _value_and_grad(name: str, loss: Callable, targets: tuple = TELEMETRY_TARGETS) -> StepFn:
    """``(params, tokens, step) -> (loss, grads, aux)`` of one instrument."""
    if name in ("fp32", "train-fp32", "train-every10-skip"):
        vg = jax.value_and_grad(loss)
        return lambda p, t, i: (*vg(p, t), None)
    if name in ("telemetry", "every10-skip"):
        observed = telemetry.observe(loss, targets).value_and_grad()
        if name == "telemetry":

            def tel(p: Any, t: jax.Array, i: jax.Array) -> tuple:
                value, grads, stats = observed(p, t)
                return value, grads, (stats, telemetry.tree_stats(grads, targets))

            return tel
        plain = jax.value_and_grad(loss)

        def skipping(p: Any, t: jax.Array, i: jax.Array) -> tuple:
            value, grads = plain(p, t)
            stats = telemetry.every(10, i, lambda p, t: observed(p, t)[2], p, t)
            return value, grads, stats

        return skipping
    if name == "emulate":
        vg = jax.value_and_grad(emulate(loss, "c=bf16"))
        return lambda p, t, i: (*vg(p, t), None)
    applied = recipes.apply(loss, name)
    rvg = applied.value_and_grad()
    if applied.recipe.stateful:  # delayed scaling: the state is part of aux, updated

        def stateful(p: Any, t: jax.Array, i: jax.Array, state: Any) -> tuple:
            value, grads, observed = rvg(state, p, t)
            return value, grads, applied.update_state(state, observed)

        stateful.init = applied.init_state  # type: ignore[attr-defined]
        return stateful
    key = jax.random.key(7)
    return lambda p, t, i: (*rvg({}, p, t, key=key)[:2], None)


def _train_step(
    name: str, loss: Callable, params: Any, tokens: Any, targets: tuple = TELEMETRY_TARGETS
) -> tuple[jax.stages.Wrapped, Any]:
    """The training loop's step (build_step), with ``Telemetry(interval=10)`` or without."""
    tel = Telemetry(interval=10, targets=targets) if name.endswith("skip") else None
    step, state, _ = build_step(
        lambda p, b: (loss(p, b), {}), params, optax.adamw(1e-3), StepOptions(telemetry=tel)
    )

    def counted(
        state: Any, tokens: jax.Array, i: jax.Array
    ) -> Any:  # the step counter set, so that the timed steps skip
        return step(state._replace(step=i), tokens)

    return jax.jit(counted, donate_argnums=0), state


def build(
    name: str, params: Any, tokens: Any, heads: int, targets: tuple = TELEMETRY_TARGETS
) -> tuple[jax.stages.Wrapped, Any]:
    """``(jitted step, initial state)``: ``step(state, tokens, i) -> (state, loss)``."""
    loss = lambda p, t: loss_fn(p, t, heads=heads)  # noqa: E731
    if name.startswith("train-"):
        return _train_step(name, loss, params, tokens, targets)
    opt = optax.adamw(1e-3)
    vg = _value_and_grad(name, loss, targets)
    init = getattr(vg, "init", None)
    extra = init(params, tokens) if init else None

    def step(state: Any, tokens: jax.Array, i: jax.Array) -> tuple[Any, Any]:
        p, s, x = state
        aux = None
        if init:  # a stateful recipe: its state rides along
            value, grads, x = vg(p, tokens, i, x)
        else:  # the instrument's output (statistics) is returned, as a user would
            value, grads, aux = vg(p, tokens, i)
        updates, s = opt.update(grads, s, p)
        return (optax.apply_updates(p, updates), s, x), (value, aux)

    state = (params, opt.init(params), extra)
    return jax.jit(step, donate_argnums=0), state


def _copy(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _interleaved(runs: dict, repeats: int) -> tuple[dict, dict]:
    """Wall and process-CPU seconds (all threads) of each run, one call of each per round:
    on a shared machine the CPU seconds do not count the time other processes held the
    cores (they still grow with the contention for caches and memory)."""
    wall: dict = {k: [] for k in runs}
    cpu: dict = {k: [] for k in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            c0, w0 = time.process_time(), time.perf_counter()
            jax.block_until_ready(fn())
            wall[name].append(time.perf_counter() - w0)
            cpu[name].append(time.process_time() - c0)
    return wall, cpu


def compile_seconds(
    name: str, params: Any, tokens: Any, heads: int, targets: tuple = TELEMETRY_TARGETS
) -> dict[str, float]:
    """CPU seconds (all threads) and wall seconds of tracing, lowering and compiling
    ``name``'s step."""
    step, state = build(name, params, tokens, heads, targets)
    c0, w0 = time.process_time(), time.perf_counter()
    lowered = step.lower(state, tokens, jnp.int32(1))
    c1 = time.process_time()
    lowered.compile()
    c2, w2 = time.process_time(), time.perf_counter()
    return {"lower_cpu_s": c1 - c0, "compile_cpu_s": c2 - c1, "total_cpu_s": c2 - c0,
            "wall_s": w2 - w0}  # fmt: skip


def measure(
    names: tuple[str, ...] = VARIANTS,
    size: ModelSize = DEFAULT_SIZE,
    *,
    targets: tuple[str, ...] = TELEMETRY_TARGETS,
    steps: int = 10,
    repeats: int = 5,
    compile_time: bool = False,
) -> dict[str, Any]:
    """Step times (ms) of every variant and their ratios to the reference (see the module
    docstring); with ``compile_time`` the compile seconds of the plain and telemetry steps."""
    load0 = os.getloadavg()
    params, tokens = size.inputs()
    heads = size.heads
    compiles = {}
    if compile_time:  # before anything else is compiled: nothing shared, no cache
        for name in ("fp32", "telemetry"):
            compiles[name] = compile_seconds(name, params, tokens, heads, targets)
    runs = {}
    for name in names:
        step, state = build(name, params, tokens, heads, targets)
        cell = [_copy(state)]
        # step counters 1..steps, never a multiple of 10 (every(10) skips them all)
        idx = [jnp.int32(i + 1 + (i + 1) // 10) for i in range(steps)]

        def run(step: jax.stages.Wrapped = step, cell: list = cell, idx: list = idx) -> Any:
            st, out = cell[0], None
            for i in idx:
                st, out = step(st, tokens, i)
            cell[0] = st
            return out

        jax.block_until_ready(run())  # compile and warm up
        runs[name] = run
    wall, cpu = _interleaved(runs, repeats)
    ms = {k: 1e3 * min(v) / steps for k, v in wall.items()}
    median = {k: 1e3 * statistics.median(v) / steps for k, v in wall.items()}
    cpu_ms = {k: 1e3 * min(v) / steps for k, v in cpu.items()}
    ratios, cpu_ratios = {}, {}
    for name in names:
        ref = TARGETS.get(name, ("fp32", None))[0]
        if name in TARGETS and ref in ms:
            ratios[name] = ms[name] / ms[ref]
            cpu_ratios[name] = cpu_ms[name] / cpu_ms[ref]
    out: dict[str, Any] = {
        "model": {
            **size._asdict(),
            "telemetry_targets": list(targets),
            "params": int(sum(x.size for x in jax.tree.leaves(params))),
        },
        "steps_per_round": steps,
        "repeats": repeats,
        "ms_per_step": ms,
        "median_ms_per_step": median,
        "ratios": ratios,
        "cpu_ms_per_step": cpu_ms,
        "cpu_ratios": cpu_ratios,
        "targets": {k: {"vs": v[0], "max": v[1]} for k, v in TARGETS.items() if k in names},
        "target_met": {k: ratios[k] <= TARGETS[k][1] for k in ratios},
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "cpu_count": os.cpu_count(),
        "load_average": {"start": load0, "end": os.getloadavg()},
    }
    if compiles:
        r = compiles["telemetry"]["total_cpu_s"] / compiles["fp32"]["total_cpu_s"]
        out["compile"] = {**compiles, "ratio": r, "target": COMPILE_TARGET,
                          "target_met": r <= COMPILE_TARGET}  # fmt: skip
    return out


def render(result: dict[str, Any]) -> str:
    m = result["model"]
    la = result["load_average"]
    head = (
        f"transformer LM ({m['params'] / 1e3:.0f}k params, {m['layers']} layers, d={m['d_model']}, "
        f"batch {m['batch']}x{m['seq']}), {result['backend']}, best of {result['repeats']} x "
        f"{result['steps_per_round']} steps, alternating; load average "
        f"{la['start'][0]:.1f} -> {la['end'][0]:.1f}; telemetry targets: "
        f"{','.join(m['telemetry_targets']) or 'none'}"
    )
    rows = []
    for name, ms in result["ms_per_step"].items():
        tgt = result["targets"].get(name)
        ratio = result["ratios"].get(name)
        cpu_ratio = result["cpu_ratios"].get(name)
        rows.append([
            name, f"{ms:.2f}", f"{result['median_ms_per_step'][name]:.2f}",
            "-" if ratio is None else f"{ratio:.2f}x",
            f"{result['cpu_ms_per_step'][name]:.2f}",
            "-" if cpu_ratio is None else f"{cpu_ratio:.2f}x",
            "-" if tgt is None else f"<= {tgt['max']:g}x {tgt['vs']}",
            "-" if tgt is None else ("met" if result["target_met"][name] else "NOT met"),
        ])  # fmt: skip
    cols = ["variant", "ms/step", "median", "ratio", "CPU ms", "CPU ratio", "target", "(wall)"]
    lines = [head, table(rows, cols, align="lrrrrrll")]
    c = result.get("compile")
    if c:
        lines.append(
            f"compile (CPU s, all threads): fp32 step {c['fp32']['total_cpu_s']:.1f}, telemetry "
            f"step {c['telemetry']['total_cpu_s']:.1f}: {c['ratio']:.2f}x (target <= "
            f"{c['target']:g}x: {'met' if c['target_met'] else 'NOT met'})"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    names = VARIANTS if args.variants is None else tuple(split_list(args.variants))
    bad = [n for n in names if n not in VARIANTS]
    if not names or bad:
        raise UsageError(
            f"--variants: unknown {bad[0]!r}; allowed: {', '.join(VARIANTS)}"
            if bad
            else f"--variants: name at least one of {', '.join(VARIANTS)}"
        )
    if "fp32" not in names:
        names = ("fp32", *names)
    if any(n.startswith("train-") for n in names) and "train-fp32" not in names:
        names = (*names, "train-fp32")
    targets = tuple(split_list(args.targets))
    try:
        parse_targets(targets)
    except ValueError as e:
        raise UsageError(f"--targets: {e}") from None
    if args.d_model % args.heads:
        raise UsageError(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}")
    if args.batch * args.seq * max(4 * args.d_model, args.vocab) > 2**28:
        raise UsageError("--batch x --seq x max(4 x --d-model, --vocab) must be at most 2**28")
    result = measure(
        names, ModelSize.from_args(args), steps=args.steps, repeats=args.repeats,
        compile_time=args.compile, targets=targets,
    )  # fmt: skip
    print_result(result, args, render)
    return 0
