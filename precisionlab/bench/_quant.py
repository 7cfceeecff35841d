"""``precisionlab bench quant``: fake_quant throughput against a plain XLA astype round trip.

Each case times, on the same float32 input, ``fake_quant`` (scales, rounding to the
element grid, dequantization) and ``x.astype(narrow).astype(float32)`` to the same width,
both jitted, and prints their ratio. The astype round trip does no scaling and no
saturation, so it is a floor, not an equivalent: the target is a ratio within 2x.

Two ratios: of the best wall times, and of the median CPU times of the process (all its
threads). On a machine shared with other jobs the wall time mostly measures the wait for a
core; the CPU time counts the work, so its ratio moves less with the load. ``amax`` is
the CPU time of fake_quant's first pass alone (the reduce of each group's max |x|), over the
astype's: fake_quant reads the input once for that reduce and once more to scale, round and
write (XLA on CPU does not fuse a reduce with its consumer), so about 1 + amax is what a
pass at the astype's speed after the reduce would give.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab._alloc import apply_malloc_tuning, malloc_tuning
from precisionlab._text import UsageError, split_list
from precisionlab.bench._output import device_and_cpu, print_result, rows_text
from precisionlab.bench._timing import Timing, positive_int, repeats_int, time_interleaved
from precisionlab.quant import _core as core
from precisionlab.quant import fake_quant
from precisionlab.quant._spec import resolve

HELP = "fake_quant throughput vs an XLA astype round trip to the same width (ratio)"

#: name -> (fake_quant arguments, astype dtype of the same width)
CASES: dict[str, tuple[dict, object]] = {
    "int8 per-channel": ({"fmt": "int8", "axis": 0}, jnp.int8),
    "int4 per-group-128": ({"fmt": "int4", "block_size": 128}, jnp.int4),
    "e4m3fn per-tensor": ({"fmt": "e4m3fn"}, jnp.float8_e4m3fn),
    "mxfp8_e4m3": ({"fmt": "mxfp8_e4m3"}, jnp.float8_e4m3fn),
    "mxfp4": ({"fmt": "mxfp4"}, jnp.float4_e2m1fn),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=positive_int, default=1024, help="input rows (default 1024)")
    parser.add_argument(
        "--cols", type=positive_int, default=4096, help="input columns (default 4096)"
    )
    parser.add_argument(
        "--repeats", type=repeats_int, default=5, help="timed calls per case (best)"
    )
    parser.add_argument("--cases", help=f"comma-separated subset of: {', '.join(CASES)}")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--malloc-tuning",
        action="store_true",
        help="apply precisionlab's opt-in glibc malloc settings first (see precisionlab._alloc): "
        "without them each call's fresh 16 MiB output may be page-faulted in, a cost both "
        "peers pay unevenly",
    )


def _astype_round_trip(dtype: Any) -> Callable[[jax.Array], jax.Array]:
    @jax.jit
    def f(x: jax.Array) -> jax.Array:
        return x.astype(dtype).astype(jnp.float32)

    return f


def _time_wall_and_cpu(
    fns: Mapping[str, Callable[[], Any]], repeats: int
) -> tuple[dict[str, Timing], dict[str, float]]:
    """Wall timings (as :func:`time_interleaved`, alternating) and the median process CPU
    seconds per call of each function, from the same calls."""
    cpu: dict[str, list[float]] = {k: [] for k in fns}

    def counted(name: str, fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            start = time.process_time()
            out = jax.block_until_ready(fn())
            cpu[name].append(time.process_time() - start)
            return out

        return run

    t = time_interleaved({k: counted(k, f) for k, f in fns.items()}, repeats=repeats)
    return t, {k: statistics.median(v[-repeats:]) for k, v in cpu.items()}


def _amax_pass(kwargs: dict) -> Callable[[jax.Array], jax.Array]:
    """The reduce fake_quant runs before its elementwise pass (per-group max of |x|), alone."""
    kw = {k: v for k, v in kwargs.items() if k != "fmt"}

    @jax.jit
    def f(x: jax.Array) -> jax.Array:
        xg, axes = core.to_groups(x, resolve(x.ndim, kwargs["fmt"], **kw))
        return core.group_amax(xg, axes)

    return f


def measure(rows: int, cols: int, repeats: int, cases: list[str]) -> list[dict]:
    """Best-of-``repeats`` times of each case and its astype peer on one (rows, cols) input."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32))
    n = rows * cols
    results = []
    for name in cases:
        kwargs, dtype = CASES[name]
        fq = jax.jit(partial(fake_quant, **kwargs))
        peer = _astype_round_trip(dtype)
        fns = {
            "fq": partial(fq, x),
            "peer": partial(peer, x),
            "amax": partial(_amax_pass(kwargs), x),
        }
        t, cpu = _time_wall_and_cpu(fns, repeats)
        t_fq, t_peer = t["fq"], t["peer"]
        ratio = lambda a, b: a / b if b > 0 else float("nan")  # noqa: E731
        results.append(
            {
                "case": name,
                "elements": n,
                "fake_quant_ms": t_fq.best * 1e3,
                "astype_ms": t_peer.best * 1e3,
                "ratio": t_fq.best / t_peer.best,
                "cpu_ratio": ratio(cpu["fq"], cpu["peer"]),
                # The group-amax reduce alone, over the astype (CPU time): fake_quant's first
                # pass over the input, before the fused scale-round-unscale pass.
                "amax_cpu_ms": cpu["amax"] * 1e3,
                "amax_ratio": ratio(cpu["amax"], cpu["peer"]),
                "fake_quant_melem_s": t_fq.rate(n) / 1e6,
                "astype_melem_s": t_peer.rate(n) / 1e6,
            }
        )
    return results


def render(results: list[dict], args: argparse.Namespace) -> str:
    """:func:`measure`'s rows as a table under a heading naming the input and the machine."""
    heading = (
        # two lines, each within the 100 columns of a terminal and of the docs' code blocks
        f"fake_quant vs astype round trip on a {args.rows}x{args.cols} float32 input\n"
        f"({device_and_cpu()}, best of {args.repeats} wall, median CPU, alternating; "
        f"malloc tuning: {'on' if malloc_tuning() else 'off'})"
    )
    head = (
        f"{'case':<20} {'fake_quant ms':>13} {'astype ms':>10} {'ratio':>6} "
        f"{'cpu ratio':>9} {'amax':>6} {'Melem/s':>8}"
    )
    lines = [
        f"{r['case']:<20} {r['fake_quant_ms']:>13.2f} {r['astype_ms']:>10.2f} "
        f"{r['ratio']:>5.2f}x {r['cpu_ratio']:>8.2f}x {r['amax_ratio']:>5.2f}x "
        f"{r['fake_quant_melem_s']:>8.1f}"
        for r in results
    ]
    return "\n".join([heading, rows_text(head, lines)])


#: Most input elements: 1 GiB of float32 (fake_quant's output and the astype's come on top).
_ELEMENTS_MAX = 1 << 28


def run(args: argparse.Namespace) -> int:
    cases = list(CASES) if args.cases is None else list(dict.fromkeys(split_list(args.cases)))
    if not cases:  # "--cases ," ran nothing and exited 0
        raise UsageError(f"--cases needs at least one name, got {args.cases!r}")
    bad = [c for c in cases if c not in CASES]
    if bad:
        raise UsageError(f"unknown case {bad[0]!r}; allowed: {', '.join(CASES)}")
    if args.rows * args.cols > _ELEMENTS_MAX:
        raise UsageError(
            f"--rows x --cols must be at most 2^28 elements (1 GiB of float32), got "
            f"{args.rows} x {args.cols}"
        )
    if args.malloc_tuning:
        apply_malloc_tuning()  # before the first computation, so XLA's threads see it
    results = measure(args.rows, args.cols, args.repeats, cases)
    print_result(results, args, lambda r: render(r, args), indent=1)
    return 0
