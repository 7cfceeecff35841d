"""Matmul models for emulate (``emulate(..., hardware=...)``).

``"float32"`` (the default and, for now, the only model): products exact (a 16-bit product
fits float32), summed in float32 in XLA:CPU's order, the sum rounded once to the result
dtype. A tensor-core model (Hopper's 16-product steps
truncated to float32, with XLA's Triton schedule) belongs to :mod:`precisionlab.hardware`; when
that lands it plugs in here as ``hardware="h100"``. Measured against an H100 (16-bit GEMMs
through XLA, jax 0.11.2): the float32 model gives the H100's float16-rounded outputs for 99.9%
of a 64x4096x64 GEMM, but the float32 accumulator itself only for 9% (float16) / 17%
(bfloat16) of its entries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["HARDWARE", "MatmulModel", "float32_once", "resolve"]

#: ``(lhs, rhs, dot_general params, result dtype) -> result``: operands hold values of the
#: program's (or policy's) 16-bit format; the result is rounded to the result dtype by emulate.
MatmulModel = Callable[[jax.Array, jax.Array, dict[str, Any], Any], jax.Array]


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


HARDWARE: dict[str, MatmulModel] = {"float32": float32_once}


def resolve(hardware: str | MatmulModel) -> MatmulModel:
    """The matmul model named ``hardware`` (a key of :data:`HARDWARE`), or a callable one."""
    if callable(hardware):
        return hardware
    if isinstance(hardware, str) and hardware in HARDWARE:
        return HARDWARE[hardware]
    raise ValueError(
        f"hardware must be one of {', '.join(HARDWARE)} or a callable "
        f"(lhs, rhs, dot_general params, dtype) -> array; got {hardware!r}"
    )
