"""``precisionlab bench hardware``: emulated tensor-core products per second beside the plain
float32 matmul of the same shape, in the same run (alternating rounds)."""

from __future__ import annotations

import argparse
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from precisionlab import hardware as hw
from precisionlab._text import UsageError
from precisionlab.bench._output import device_and_cpu, print_result, rows_text
from precisionlab.bench._timing import positive_int, repeats_int, time_interleaved

HELP = "hardware GEMM models: emulated products/s vs a float32 matmul of the same shape"

#: name -> (operand dtype, gemm keyword arguments); float4 operands get NVFP4 block scales
#: (float8_e4m3fn per 16) and run Blackwell's 35-bit step in the two-limb kernel
CASES: dict[str, tuple[type[np.generic], dict[str, Any]]] = {
    "h100-cublaslt-fast fp8": (ml_dtypes.float8_e4m3fn, hw.preset("h100-cublaslt-fast")),
    "h100-cublaslt fp8 (promote 128)": (ml_dtypes.float8_e4m3fn, hw.preset("h100-cublaslt")),
    "h100-cublaslt float16": (np.float16, hw.preset("h100-cublaslt")),
    "h100-cublaslt bfloat16": (ml_dtypes.bfloat16, hw.preset("h100-cublaslt")),
    "b200-cublaslt nvfp4 (2 limbs)": (ml_dtypes.float4_e2m1fn, hw.preset("b200-cublaslt")),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--m", type=positive_int, default=256, help="rows of a (default 256)")
    parser.add_argument("--n", type=positive_int, default=256, help="columns of b (default 256)")
    parser.add_argument("--k", type=positive_int, default=2048, help="contraction (default 2048)")
    parser.add_argument("--repeats", type=repeats_int, default=3, help="timed calls (best)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def measure(m: int, n: int, k: int, repeats: int) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    f32 = jax.jit(lambda x, y: jnp.matmul(x.astype(jnp.float32), y.astype(jnp.float32)))
    for name, (dt, kw) in CASES.items():
        a = jnp.asarray(rng.standard_normal((m, k)).astype(dt))
        b = jnp.asarray(rng.standard_normal((k, n)).astype(dt))
        if dt is ml_dtypes.float4_e2m1fn:
            if k % 64:
                continue  # the FP4 instruction takes K in multiples of 64
            kw = {**kw, "block_scale_a": jnp.ones((m, k // 16), jnp.float8_e4m3fn),
                  "block_scale_b": jnp.ones((k // 16, n), jnp.float8_e4m3fn)}  # fmt: skip
        fns = {"model": partial(hw.gemm, a, b, **kw), "f32": partial(f32, a, b)}
        t = time_interleaved(fns, repeats=repeats)
        prod = m * n * k
        out.append({
            "case": name, "model_ms": t["model"].best * 1e3, "f32_ms": t["f32"].best * 1e3,
            "model_Mproducts_s": prod / t["model"].best / 1e6,
            "f32_Mproducts_s": prod / t["f32"].best / 1e6,
        })  # fmt: skip
    return out


def render(res: list[dict], args: argparse.Namespace) -> str:
    """:func:`measure`'s rows as a table under a heading naming the sizes and the machine."""
    heading = (
        f"hardware GEMM models, {args.m}x{args.k} @ {args.k}x{args.n} ({device_and_cpu()}, "
        f"jax {jax.__version__}),\nbest of {args.repeats}, alternating with a float32 matmul"
    )
    head = f"{'case':<31} {'model ms':>9} {'f32 ms':>8} {'M products/s':>13} {'f32 / model':>11}"
    lines = [
        f"{r['case']:<31} {r['model_ms']:>9.1f} {r['f32_ms']:>8.2f} "
        f"{r['model_Mproducts_s']:>13.0f} {r['model_ms'] / r['f32_ms']:>10.0f}x"
        for r in res
    ]
    return "\n".join([heading, rows_text(head, lines)])


def run(args: argparse.Namespace) -> int:
    if args.m * args.n * args.k > 2**34:
        raise UsageError("--m x --n x --k must be at most 2^34 products")
    try:  # before the inputs are made: a MemoryError otherwise
        hw.check_gemm_size(args.m, args.k, args.n)
    except ValueError as err:
        raise UsageError(f"--m {args.m} --k {args.k} --n {args.n}: {err}") from None
    res = measure(args.m, args.n, args.k, args.repeats)
    print_result(res, args, lambda r: render(r, args), indent=1)
    return 0
