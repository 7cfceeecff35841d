"""``conformance --gemm``: the GEMMs on this machine beside the hardware models.

Each case is a random GEMM (standard normal operands rounded to the input format). Every GEMM
implementation available here (XLA on each backend present, numpy, torch if installed)
computes it with float32 output; each cell is the share of outputs bit-identical to a model:
the exact product rounded once to float32, and the tensor-core models of
:mod:`precisionlab.hardware`. A GPU's cuBLASLt or XLA should match its device's row;
a CPU usually matches none of the tensor-core models (it sums in float32 in its own order).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from precisionlab import hardware as hw
from precisionlab._text import table

__all__ = ["GEMM_CASES", "GemmResult", "gemm_tables", "run_gemm_conformance"]

#: case name -> (operand dtype, M, K, N)
GEMM_CASES = {
    "e4m3 K=256": (ml_dtypes.float8_e4m3fn, 32, 256, 32),
    "e4m3 K=4096": (ml_dtypes.float8_e4m3fn, 16, 4096, 16),
    "float16 K=1024": (np.float16, 32, 1024, 32),
    "bfloat16 K=1024": (ml_dtypes.bfloat16, 32, 1024, 32),
}
#: model name -> gemm keyword arguments (None: exact, rounded once)
MODELS: dict[str, dict | None] = {
    "exact-once": None,
    "h100-cublaslt-fast": hw.preset("h100-cublaslt-fast"),
    "h100-cublaslt": hw.preset("h100-cublaslt"),
    "h100-xla": hw.preset("h100-xla"),
    "a100-cublaslt": hw.preset("a100-cublaslt"),
    "b200-cublaslt": hw.preset("b200-cublaslt"),
}


@dataclasses.dataclass
class GemmResult:
    implementations: list[str]
    cases: list[str]
    #: (implementation, case, model) -> share of bit-identical outputs; None: not applicable
    share: dict[tuple[str, str, str], float | None]


def _implementations() -> dict[str, Callable]:
    out: dict[str, Callable] = {}
    for dev in {d.platform: d for d in jax.devices()}.values():

        def xla(a: np.ndarray, b: np.ndarray, dev: jax.Device = dev) -> np.ndarray:
            x, y = jax.device_put(a, dev), jax.device_put(b, dev)
            dn = (((1,), (0,)), ((), ()))
            return np.asarray(jax.lax.dot_general(x, y, dn, preferred_element_type=jnp.float32))

        out[f"xla:{dev.platform}"] = xla
    out["numpy"] = lambda a, b: a.astype(np.float32) @ b.astype(np.float32)
    try:
        import torch

        def tmm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            ta = torch.from_numpy(a.astype(np.float32))
            tb = torch.from_numpy(b.astype(np.float32))
            return (ta @ tb).numpy()

        out[f"torch {torch.__version__} cpu float32"] = tmm
    except ImportError:
        pass
    return out


def _same(y: np.ndarray, ref: np.ndarray) -> float:
    y = np.asarray(y, np.float32).view(np.uint32)
    return float(np.mean(y == np.asarray(ref, np.float32).view(np.uint32)))


def run_gemm_conformance(seed: int = 0) -> GemmResult:
    rng = np.random.default_rng(seed)
    impls = _implementations()
    share: dict[tuple[str, str, str], float | None] = {}
    for case, (dt, m, k, n) in GEMM_CASES.items():
        a = rng.standard_normal((m, k)).astype(dt)
        b = rng.standard_normal((k, n)).astype(dt)
        refs: dict[str, np.ndarray | None] = {}
        for model, kw in MODELS.items():
            if kw is None:
                refs[model] = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)
                continue
            try:
                refs[model] = np.asarray(hw.gemm(a, b, **kw))
            except ValueError:  # the device has no such tensor core
                refs[model] = None
        for name, fn in impls.items():
            y = fn(a, b)
            for model, ref in refs.items():
                share[(name, case, model)] = None if ref is None else _same(y, ref)
    return GemmResult(list(impls), list(GEMM_CASES), share)


def gemm_tables(res: GemmResult) -> list[tuple[str, str]]:
    """One text table per case: implementations x models, percent bit-identical."""
    tables = []
    for case in res.cases:
        rows = []
        for impl in res.implementations:
            cells = [impl]
            for model in MODELS:
                v = res.share[(impl, case, model)]
                cells.append("n/a" if v is None else f"{100 * v:.1f}%")
            rows.append(cells)
        text = table(rows, ["GEMM", *MODELS], "l" + "r" * len(MODELS))  # columns fit the names
        tables.append((f"{case}: outputs bit-identical to each model", text))
    return tables
