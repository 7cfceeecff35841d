"""Search GEMM schedules against an H100 capture (a tool, not a test; minutes per case).

    PYTHONPATH=$PWD python tools/hardware_schedule_search.py KEY [WIDTH ...]

KEY: an XLA capture in tests/data/h100_gemm.npz, ``fp8_xla_{DEFAULT,HIGHEST}_{K}`` (64 x K x
64) or ``xla_P4_fp8_{K}`` (32 x K x 32). Each slice of WIDTH k (default: the HLO's slice for
P4, else 32 .. K) is computed with every step of :data:`STEPS` (and every promotion interval
of :data:`RESTARTS` below the width) by ``precisionlab.hardware.gemm``, and the slices are
summed in float32 in order, in reverse and in every butterfly bit order; the share of outputs
equal to the capture is printed for the best, and every 100% match.
docs/explanations/hardware-validation.md lists what it found and what it ruled out.
"""

from __future__ import annotations

import itertools
import pathlib
import sys

import jax
import ml_dtypes
import numpy as np

from precisionlab import hardware as hw

DATA = np.load(pathlib.Path(__file__).parents[1] / "tests" / "data" / "h100_gemm.npz")
E4 = ml_dtypes.float8_e4m3fn
_FP8 = {"library": "cublaslt", "fast_accumulation": True, "split_k": None}
_UP = {"library": "xla", "split_k": None}  # FP8: float16 steps, k in FP8 register pairs
_N = {**_UP, "k_order": "natural"}

#: step hypotheses: name -> hardware.gemm keyword arguments for one slice
STEPS: dict[str, dict] = {
    "f16 upcast, 16 products, 25 bits, fp8 pairs": _UP,
    "f16 upcast, 16 products, 25 bits": {**_UP, "k_order": "natural"},
    "bf16 upcast, 16 products, 25 bits": {**_UP, "upcast": "bfloat16", "k_order": "natural"},
    "f16 upcast, 8 products, 24 bits": {**_N, "products": 8, "fraction_bits": 24},
    "f16 upcast, 8 products, 25 bits": {**_N, "products": 8, "fraction_bits": 25},
    "f16 upcast, 4 products, 23 bits": {**_N, "products": 4, "fraction_bits": 23},
    "fp8 wgmma, 32 products, 13 bits": _FP8,
    "fp8, 32 products, 12 bits": {**_FP8, "fraction_bits": 12},
    "fp8, 32 products, 14 bits": {**_FP8, "fraction_bits": 14},
    "fp8, 32 products, 13 bits, 24-bit result": {**_FP8, "result_bits": 24},
    "fp8, 32 products, 24 bits": {**_FP8, "fraction_bits": 24, "result_bits": 24},
    "fp8, 32 products, 25 bits": {**_FP8, "fraction_bits": 25, "result_bits": 24},
    "fp8, 16 products, 13 bits": {**_FP8, "products": 16},
    "fp8, 16 products, 25 bits": {**_FP8, "products": 16, "fraction_bits": 25, "result_bits": 24},
    "fp8, 32 products, 13 bits, flush": {**_FP8, "subnormal_inputs": "flush"},
    "fp8, 32 products, 25 bits, flush": {**_FP8, "fraction_bits": 25, "result_bits": 24,
                                         "subnormal_inputs": "flush"},
}  # fmt: skip
RESTARTS = (None, 32, 64, 128, 256)
P4_WIDTH = {512: 32, 2048: 64, 8192: 128}  # from xla_hlo_probe3.txt


def _slices(a: np.ndarray, b: np.ndarray, w: int, kw: dict) -> np.ndarray:
    """(K / w, M, N) float32: each w-wide slice as ``hardware.gemm`` computes it."""
    m, k = a.shape
    sa = a.reshape(m, k // w, w).transpose(1, 0, 2)
    sb = b.reshape(k // w, w, -1)
    return np.asarray(jax.vmap(lambda x, y: hw.gemm(x, y, "h100", **kw))(sa, sb), np.float32)


def _orders(n: int):
    yield "in order", None
    yield "reverse", None
    bits = n.bit_length() - 1
    if 2**bits == n:
        yield from ((p, p) for p in itertools.permutations(range(bits)))


def _sum(parts: np.ndarray, name, order) -> np.ndarray:
    if order is None:
        seq = parts if name == "in order" else parts[::-1]
        acc = seq[0]
        for p in seq[1:]:
            acc = (acc + p).astype(np.float32)
        return acc
    nb = len(order)
    x = parts.reshape((2,) * nb + parts.shape[1:])
    labels = list(range(nb - 1, -1, -1))  # axis j holds bit nb - 1 - j
    for bit in order:
        ax = labels.index(bit)
        x = (np.take(x, 0, axis=ax) + np.take(x, 1, axis=ax)).astype(np.float32)
        labels.pop(ax)
    return x


def search(a: np.ndarray, b: np.ndarray, ref: np.ndarray, widths) -> tuple:
    """Best (share, width, step, restart, order) over the hypotheses; prints every match."""
    refb = np.asarray(ref, np.float32).view(np.uint32)
    best: tuple = (0.0,)
    for w in (w for w in widths if a.shape[1] % w == 0):
        for (name, kw), r in itertools.product(STEPS.items(), RESTARTS):
            if r is not None and r >= w:
                continue
            parts = _slices(a, b, w, kw if r is None else {**kw, "restart_every": r})
            for oname, order in _orders(len(parts)):
                share = float(np.mean(_sum(parts, oname, order).view(np.uint32) == refb))
                if share > best[0]:
                    best = (share, w, name, r, oname)
                if share == 1.0:
                    print("match:", w, name, r, oname, flush=True)
    return best


def main(argv: list[str]) -> None:
    key, widths = argv[0], [int(x) for x in argv[1:]]
    k = int(key.rsplit("_", 1)[1])
    if key.startswith("xla_P4_fp8_"):
        a, b = DATA[f"a_P4_fp8_{k}"].view(E4), DATA[f"b_P4_fp8_{k}"].view(E4)
        ref = DATA[key][0] if DATA[key].ndim == 3 else DATA[key]
        widths = widths or [P4_WIDTH[k]]
    else:
        a, b, ref = DATA[f"fp8_a_{k}"].view(E4), DATA[f"fp8_b_{k}"].view(E4), DATA[key]
        widths = widths or [w for w in (32, 64, 128, 256, 512, 1024, 2048, k) if w <= k]
    print(key, "best:", search(a, b, ref, widths))


if __name__ == "__main__":
    main(sys.argv[1:])
