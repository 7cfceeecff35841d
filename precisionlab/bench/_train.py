"""``precisionlab bench train``: cost of mixed precision, loss scaling and the skip, in one run.

Step time of the same model, data and optimizer (Adam) written four ways:

  (a) fp32: the plain float32 step;
  (b) bf16: bfloat16 compute with float32 master weights, no loss scaling;
  (c) bf16 + dynamic loss scaling + skip on non-finite gradients (precisionlab's step; the skip
      is a ``lax.cond`` around the update; also "c-select": the skip as a leafwise select between
      the new and the old state, which makes XLA keep both trees and add copies);
  (d) the same as (c) written with jmp (``jmp.DynamicLossScale``, ``jmp.all_finite``,
      ``jmp.select_tree`` over the new and old params and optimizer state).

All variants run the same forward (precisionlab's model under the same policy) and are timed
interleaved, one chunk of steps each per round, best of ``--repeats`` rounds. The targets:
c/b <= 1.03 and c no slower than d. Note (c) also computes the per-step metrics (gradient norm,
underflow meter) that (d) does not.

On CPU, bf16 and fp16 matmuls are usually slower than float32: XLA's CPU backend has no native
16-bit GEMM on most x86 cores, so it converts the operands to float32, multiplies, and rounds the
result back, paying for two extra passes over the data; the numbers measure the mixed-precision
bookkeeping, not a hardware speed-up (which needs bf16/fp16 matrix units, as on GPUs and TPUs).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from precisionlab._text import UsageError, table
from precisionlab.bench import _output, _timing
from precisionlab.mixed import get_policy
from precisionlab.train import make_data, make_model, make_train_step

HELP = "train-step time: fp32, bf16, bf16+dynamic loss scaling+skip, and jmp's version"

VARIANTS = ("a-fp32", "b-bf16", "c-bf16-dyn", "c-select", "d-jmp")

# model -> (dataset, its options): conv reads the teacher's 64 inputs as an 8x8 image (no
# optional dependency, unlike the digits set)
_DATA: dict[str, tuple[str, dict[str, Any]]] = {
    "mlp": ("teacher", {}),
    "transformer": ("markov", {}),
    "conv": ("teacher", {"in_dim": 64}),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="mlp", help="built-in model: mlp, transformer or conv")
    parser.add_argument(
        "--batch", type=_timing.positive_int, default=128, help="batch size (default 128)"
    )
    parser.add_argument(
        "--steps", type=_timing.repeats_int, default=20, help="steps per timed chunk (default 20)"
    )
    parser.add_argument(
        "--repeats", type=_timing.repeats_int, default=7, help="timed rounds, best kept (default 7)"
    )
    parser.add_argument(
        "--compute", default="bfloat16", help="compute dtype of (b)-(d): bfloat16 or float16"
    )
    _output.add_output_arguments(parser)


def _jmp_step(loss_fn: Callable, optimizer: Any, policy: Any) -> Callable:
    import jmp

    def step(carry: tuple[Any, Any, Any], batch: Any) -> tuple[tuple[Any, Any, Any], Any]:
        params, opt_state, ls = carry

        def scaled(p: Any) -> jax.Array:
            loss, _ = loss_fn(policy.cast_to_compute(p), batch)
            return ls.scale(loss)

        grads = ls.unscale(jax.grad(scaled)(params))
        finite = jmp.all_finite(grads)
        updates, new_opt = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp.select_tree(finite, (new_params, new_opt), (params, opt_state))
        return (params, opt_state, ls.adjust(finite)), finite

    return step


def _runner(step: Callable, state: Any, batches: Any) -> Callable[[], Any]:
    jstep = jax.jit(step, donate_argnums=0)
    # Each variant owns its buffers: the state is donated to the step.
    cell = [jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), state)]

    def run() -> Any:
        s = cell[0]
        out = None
        for b in batches:
            s, out = jstep(s, b)
        cell[0] = s
        return out

    return run


def measure(
    model_name: str = "mlp",
    batch: int = 128,
    steps: int = 20,
    repeats: int = 7,
    compute: str = "bfloat16",
) -> dict[str, Any]:
    """Time the variants; returns ms/step per variant and the ratios."""
    cdt = get_policy(compute).compute_dtype.name
    if cdt not in ("bfloat16", "float16"):
        raise UsageError(f"--compute must be bfloat16 or float16, got {compute!r}")
    if model_name not in _DATA:
        raise UsageError(f"--model must be mlp, transformer or conv, got {model_name!r}")
    data_name, data_kwargs = _DATA[model_name]
    data = make_data(data_name, **data_kwargs)
    model = make_model(model_name, **data.model_kwargs())
    params = model.init(jax.random.PRNGKey(0))
    batches = [jax.device_put(data.batch(i, batch)) for i in range(steps)]
    opt = optax.adam(1e-3)
    mixed = get_policy(f"p=f32,c={cdt},o=f32")
    fp32 = get_policy("float32")
    runs = {}
    s, st = make_train_step(model.loss_fn(fp32), params, opt, policy=fp32)
    runs["a-fp32"] = _runner(s, st, batches)
    s, st = make_train_step(model.loss_fn(mixed), params, opt, policy=mixed)
    runs["b-bf16"] = _runner(s, st, batches)
    s, st = make_train_step(model.loss_fn(mixed), params, opt, policy=mixed, loss_scale="dynamic")
    runs["c-bf16-dyn"] = _runner(s, st, batches)
    s, st = make_train_step(
        model.loss_fn(mixed), params, opt, policy=mixed, loss_scale="dynamic", skip="select"
    )
    runs["c-select"] = _runner(s, st, batches)
    try:
        import jmp
    except ImportError:
        jmp = None
    if jmp is not None:
        ls = jmp.DynamicLossScale(np.float32(2.0**15))
        runs["d-jmp"] = _runner(
            _jmp_step(model.loss_fn(mixed), opt, mixed), (params, opt.init(params), ls), batches
        )
    times = _timing.time_interleaved(runs, repeats=repeats, warmup=1)
    ms = {k: 1e3 * t.best / steps for k, t in times.items()}
    ratios = {
        "b/a": ms["b-bf16"] / ms["a-fp32"],
        "c/b": ms["c-bf16-dyn"] / ms["b-bf16"],
        "c-select/b": ms["c-select"] / ms["b-bf16"],
    }
    if "d-jmp" in ms:
        ratios["c/d"] = ms["c-bf16-dyn"] / ms["d-jmp"]
        ratios["d/b"] = ms["d-jmp"] / ms["b-bf16"]
    return {
        "model": model_name,
        "params": model.param_count(params),
        "batch": batch,
        "compute": cdt,
        "steps_per_round": steps,
        "repeats": repeats,
        "ms_per_step": ms,
        "ratios": ratios,
        "targets": {
            "c/b <= 1.03": ratios["c/b"] <= 1.03,
            "c <= d": ratios["c/d"] <= 1.0 if "c/d" in ratios else None,
        },
        **_output.machine(),
    }


def render(result: dict[str, Any]) -> str:
    labels = {
        "a-fp32": "(a) float32",
        "b-bf16": f"(b) {result['compute']} compute, fp32 master",
        "c-bf16-dyn": "(c) (b) + dynamic loss scale + skip (lax.cond)",
        "c-select": "(c') (b) + dynamic loss scale + skip (select)",
        "d-jmp": "(d) (c) written with jmp + select_tree",
    }
    b = result["ms_per_step"]["b-bf16"]
    rows = [[labels[k], f"{v:.3f}", f"{v / b:.3f}"] for k, v in result["ms_per_step"].items()]
    head = (
        f"model {result['model']} ({result['params']:,} params), batch {result['batch']}, "
        f"{result['backend']}, best of {result['repeats']} x {result['steps_per_round']} "
        "steps"
    )
    ratios = "  ".join(f"{k} = {v:.3f}" for k, v in result["ratios"].items())
    verdict = {True: "met", False: "NOT met", None: "not measured (install the bench extra)"}
    targets = "  ".join(f"{k}: {verdict[ok]}" for k, ok in result["targets"].items())
    return "\n".join(
        [head, table(rows, ["variant", "ms/step", "vs (b)"], align="lrr"), ratios, targets]
    )


def run(args: argparse.Namespace) -> int:
    result = measure(args.model, args.batch, args.steps, args.repeats, args.compute)
    _output.print_result(result, args, render)
    return 0
