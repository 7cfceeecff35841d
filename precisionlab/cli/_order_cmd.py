"""``precisionlab order``: the summation order of a reduction or GEMM on the running backend
(XLA's reduce and dot; torch if installed; or a hardware model), revealed with FPRev's
masking-value probes and printed as a tree, optionally compared with a hardware preset's
schedule."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from precisionlab.cli._common import UsageError

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np

HELP = "reveal the summation order of a reduction or GEMM here (FPRev's probes), as a tree"

OPS = ("sum", "dot")
DTYPES = ("float32", "bfloat16", "float16")
MAX_K = 4096
# the small probe value's count must stay exact in the op's own accumulation
_SUM_K = {"float32": MAX_K, "bfloat16": 256, "float16": 2048}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", default="sum", choices=OPS,
                        help="sum: a reduction of K values; dot: one output of an "
                        "(M, K) x (K, N) GEMM accumulated in float32")  # fmt: skip
    parser.add_argument("--k", type=int, default=32, help=f"inputs summed (2..{MAX_K})")
    parser.add_argument("--dtype", default="float32", help=f"input dtype ({', '.join(DTYPES)})")
    parser.add_argument("--m", type=int, default=1, help="GEMM rows (dot; default 1)")
    parser.add_argument("--n", type=int, default=1, help="GEMM columns (dot; default 1)")
    parser.add_argument(
        "--backend", default="jax",
        help="jax (XLA on the running backend), torch (if installed), or a "
        "precisionlab.hardware preset (its model, dot only: h100-xla, h100-cublaslt, ...)",
    )  # fmt: skip
    parser.add_argument("--compare", default=None, metavar="PRESET",
                        help="compare with this hardware preset's schedule at K")  # fmt: skip
    parser.add_argument("--width", type=int, default=100, help="line width of the tree")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _check(args: argparse.Namespace) -> None:
    from precisionlab import hardware

    if args.dtype not in DTYPES:
        raise UsageError(f"--dtype: unknown {args.dtype!r}; allowed: {', '.join(DTYPES)}")
    high = MAX_K if args.op == "dot" else _SUM_K[args.dtype]
    if not 2 <= args.k <= high:
        raise UsageError(f"--k: {args.k} is out of range; allowed 2..{high} for {args.op} of "
                         f"{args.dtype}")  # fmt: skip
    for flag in ("m", "n"):
        if not 1 <= getattr(args, flag) <= 4096:
            raise UsageError(f"--{flag}: {getattr(args, flag)} is out of range; allowed 1..4096")
    if not 20 <= args.width <= 1000:
        raise UsageError(f"--width: {args.width} is out of range; allowed 20..1000")
    for flag, name in (("--compare", args.compare),
                       ("--backend", args.backend if args.backend not in ("jax", "torch")
                        else None)):  # fmt: skip
        if name is not None:
            try:
                hardware.canonical_preset(name)
            except ValueError as err:
                raise UsageError(f"{flag}: {err}" + ("; or jax, torch" if flag == "--backend"
                                                      else "")) from None  # fmt: skip
    if args.backend not in ("jax", "torch") and args.op != "dot":
        raise UsageError("--backend PRESET models a GEMM: use it with --op dot")
    if args.compare and args.dtype == "float32":
        raise UsageError("--compare: the hardware models take 16-bit inputs; use --dtype "
                         "bfloat16 or float16")  # fmt: skip


def _black_box(args: argparse.Namespace) -> tuple[Callable[[np.ndarray], float], str]:
    """(fn(probe vector float64 [K]) -> float, description)."""
    import numpy as np

    k, m, n, dt = args.k, args.m, args.n, args.dtype
    if args.backend == "torch":
        try:
            import torch
        except ImportError:
            raise UsageError("--backend torch: torch is not installed") from None
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        tdt = getattr(torch, dt)
        if args.op == "sum":

            def fn(x: np.ndarray) -> float:
                return float(torch.sum(torch.tensor(x, dtype=tdt, device=dev)))
        else:
            b = torch.ones((k, n), dtype=tdt, device=dev)
            rest = torch.zeros((m, k), dtype=tdt, device=dev)

            def fn(x: np.ndarray) -> float:
                a = rest.clone()
                a[0] = torch.tensor(x, dtype=tdt, device=dev)
                return float((a @ b)[0, 0])

        return fn, f"torch {torch.__version__} on {dev}"
    import jax
    import jax.numpy as jnp

    from precisionlab.consistency._invariance import backend_name

    if args.backend == "jax":
        if args.op == "sum":
            f = jax.jit(jnp.sum)

            def fn(x: np.ndarray) -> float:
                return float(f(jnp.asarray(x, dt)))

            return fn, f"XLA's reduce on {backend_name()}, jax {jax.__version__}"
        g = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
        what = f"XLA's dot on {backend_name()}, jax {jax.__version__}"
    else:
        from precisionlab import hardware

        kw = hardware.preset(args.backend)
        g = jax.jit(lambda a, b: hardware.gemm(a, b, **kw))
        what = f"the {hardware.canonical_preset(args.backend)} model (precisionlab.hardware)"
    b = jnp.ones((k, n), dt)
    zeros = np.zeros((m, k), np.float64)

    def dot(x: np.ndarray) -> float:
        a = zeros.copy()
        a[0] = x
        return float(g(jnp.asarray(a, dt), b)[0, 0])

    return dot, what


def run(args: argparse.Namespace) -> int:
    _check(args)
    from precisionlab.consistency import _order as order

    fn, what = _black_box(args)
    large, small = order.masking_values(args.dtype)
    try:
        tree = order.reveal(fn, args.k, large=large, small=small)
    except ValueError as err:
        raise UsageError(f"{what}: {err}") from None
    diff = None
    if args.compare:
        ref = order.schedule_tree(args.compare, args.k, args.dtype)
        missing = ref.diff(tree)
        diff = "matches" if missing is None else (
            f"differs: the model computes {missing}, the revealed order does not"
        )  # fmt: skip
    if args.json:
        print(json.dumps({"op": args.op, "k": args.k, "dtype": args.dtype, "m": args.m,
                          "n": args.n, "black_box": what, "probes": tree.probes,
                          "all_pairs": args.k * (args.k - 1) // 2, "tree": tree.to_json(),
                          "compare": args.compare, "comparison": diff}))  # fmt: skip
        return 0
    shape = "" if args.op == "sum" else f" (M={args.m}, N={args.n}, output [0, 0])"
    # two lines: a model's name and the shape make one line over 100 columns
    print(f"{args.op} of K={args.k} {args.dtype} inputs{shape}")
    print(f"by {what}: {tree.probes} probes (all pairs: {args.k * (args.k - 1) // 2})")
    print(tree.text(args.width))
    if args.compare:
        print(f"{args.compare} at K={args.k}: {diff}")
    return 0
