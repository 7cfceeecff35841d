"""Matmul models for emulate (``emulate(..., hardware=...)``).

- ``"h100"`` (the default): what XLA's Triton GEMMs compute on an H100. 16-bit (and 8-bit)
  operands run through :func:`precisionlab.hardware.dot_general`'s Hopper tensor-core steps
  (16 products a step, aligned and truncated, the sum truncated to float32) with the split-K
  schedule of :func:`xla_split`, chosen by K; the float32 sum is then rounded to the result
  dtype. Measured on the float16 MLP capture (tests/data/h100_emulate.npz): forward 100%,
  weight gradient 99.4% of outputs bit for bit (the float32 model: 99.4% and 82.2%).
- ``"float32"``: products exact (a 16-bit product fits float32), summed in float32 in
  XLA:CPU's order, the sum rounded once to the result dtype (the previous default; faster).
- any other name of :data:`precisionlab.hardware.PRESETS` (``"h100-fast"``, ``"h100-xla"``,
  ``"a100"``, ...): that preset's step and schedule as it stands, for every shape.
- a callable ``(lhs, rhs, dot_general params, result dtype) -> result``.

A ``dot_general`` whose operands are not both 16-bit of one format, or both 8-bit, (float32
operands of a float32 program that computes in float32 on purpose, integer matmuls) uses
``"float32"`` under every name: the tensor-core models cover 8- and 16-bit inputs only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from precisionlab import hardware

__all__ = ["HARDWARE", "MatmulModel", "float32_once", "names", "resolve", "xla_split"]

#: ``(lhs, rhs, dot_general params, result dtype) -> result``: operands hold values of the
#: program's (or policy's) 8- or 16-bit format, in that dtype where the program's operand is
#: float32 (a float32 program under a 16-bit policy); emulate rounds the result to its target.
MatmulModel = Callable[[jax.Array, jax.Array, dict[str, Any], Any], jax.Array]

_NARROW = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def float32_once(lhs: jax.Array, rhs: jax.Array, params: dict[str, Any], out_dtype) -> jax.Array:
    """``dot_general`` with float32 accumulation, returned in ``out_dtype`` (rounded once)."""
    out = lax.dot_general(
        lhs.astype(jnp.promote_types(lhs.dtype, jnp.float32)),
        rhs.astype(jnp.promote_types(rhs.dtype, jnp.float32)),
        params["dimension_numbers"],
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.promote_types(out_dtype, jnp.float32),
    )
    return out.astype(out_dtype)


def xla_split(k: int) -> dict[str, Any]:
    """The split-K schedule taken for XLA's Triton GEMM on an H100 at contraction length
    ``k`` (``hardware.gemm`` overrides). From the captures: K <= 64 runs one chain (``xla_P1``
    to ``P3``); K = 128, 256, 512 (the MLP's GEMMs and their transposes) fit 64-wide slices
    summed in float32 in order best; K = 4096 at 64 x 64 outputs is 128-wide slices summed by
    halves (``g16``). XLA picks its tiling per shape (M and N too), so other shapes are a
    guess: slices of 64 below K = 4096, of 128 (by halves where their count is a power of two,
    else in order) from there. (The FP8 64 x 1024 x 64 capture summed its 64-wide slices by
    halves: the order at a given K is not settled.)"""
    if k <= 64:
        return {"split_k": None}
    if k < 4096:
        return {"split_k": 64, "split_order": "sequential"}
    n = math.ceil(k / 128)
    if n & (n - 1) == 0:
        return {"split_k": 128, "split_order": tuple(reversed(range(n.bit_length() - 1)))}
    return {"split_k": 128, "split_order": "sequential"}


def _narrow_pair(lhs: jax.Array, rhs: jax.Array) -> bool:
    ln, rn = jnp.dtype(lhs.dtype).name, jnp.dtype(rhs.dtype).name
    if ln not in _NARROW or rn not in _NARROW:
        return False
    eight = ("float8" in ln) and ("float8" in rn)
    return eight or ln == rn


def _tensor_core(lhs, rhs, params, out_dtype, *, preset: str, by_k: bool) -> jax.Array:
    if not _narrow_pair(lhs, rhs):
        return float32_once(lhs, rhs, params, out_dtype)
    dn = params["dimension_numbers"]
    (lc, _), _ = dn
    k = math.prod(int(lhs.shape[d]) for d in lc)
    ov = xla_split(k) if by_k else {}
    y = hardware.dot_general(lhs, rhs, dn, preset=preset, out_dtype=jnp.float32, **ov)
    return y.astype(out_dtype)


#: emulate's own names; every other name of ``hardware.PRESETS`` is accepted too.
HARDWARE: dict[str, MatmulModel] = {
    "h100": partial(_tensor_core, preset="h100-xla", by_k=True),
    "float32": float32_once,
}


def names() -> tuple[str, ...]:
    """Every name ``hardware=`` accepts."""
    return (*HARDWARE, *(p for p in hardware.PRESETS if p not in HARDWARE))


def resolve(name: str | MatmulModel) -> MatmulModel:
    """The matmul model ``name`` (see the module docstring), or a callable one."""
    if callable(name):
        return name
    if isinstance(name, str) and name in HARDWARE:
        return HARDWARE[name]
    if isinstance(name, str) and name in hardware.PRESETS:
        return partial(_tensor_core, preset=name, by_k=False)
    raise ValueError(
        f"hardware must be one of {', '.join(names())} or a callable "
        f"(lhs, rhs, dot_general params, dtype) -> array; got {name!r}"
    )
