"""Matmul models for emulate (``emulate(..., hardware=...)``).

- ``"h100-xla"`` (the default): what XLA's Triton GEMMs compute on an H100, the preset of the
  same name in :data:`precisionlab.hardware.PRESETS`. 16-bit (and 8-bit) operands run
  through :func:`precisionlab.hardware.dot_general`'s Hopper tensor-core steps (16 products a
  step, aligned and truncated, the sum truncated to float32) with the split-K schedule of
  :func:`precisionlab.hardware.xla_split`, chosen by K; the float32 sum is then rounded to the
  result dtype. Measured on the float16 MLP capture (tests/data/h100_emulate.npz): forward
  100%, weight gradient 99.4% of outputs bit for bit (the float32 model: 99.4% and 82.2%).
- ``"float32"``: products exact (a 16-bit product fits float32), summed in float32 in
  XLA:CPU's order, the sum rounded once to the result dtype (the previous default; faster).
- any other preset or alias of :mod:`precisionlab.hardware` (``"h100-cublaslt-fast"``,
  ``"h100-cublaslt"``, ``"a100"``, ...): that preset, as ``hardware.gemm`` computes it.
  ``"h100"`` is refused as ambiguous (it meant XLA here and cuBLASLt in recipes): the
  error names the choices.
- a callable ``(lhs, rhs, dot_general params, result dtype) -> result``.

A ``dot_general`` whose operands are not both 16-bit of one format, or both 8-bit, (float32
operands of a float32 program that computes in float32 on purpose, integer matmuls) uses
``"float32"`` under every name: the tensor-core models cover 8- and 16-bit inputs only.

A convolution (``conv_general_dilated``, forward and the transposed convolutions of its
gradient) runs through the same model as the implicit GEMM over its patches
(:func:`implicit_gemm`, :mod:`precisionlab.hardware._conv`): K = (kernel taps row-major, then
the input channels fastest), the channels-last order of cuDNN's tensor-core convolutions.
That order and the schedule of the GEMM model are assumed, not checked against a GPU capture.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from precisionlab import hardware
from precisionlab.hardware._conv import from_params
from precisionlab.hardware._gemm import BATCHED_GEMM_DIMS

__all__ = [
    "DEFAULT",
    "HARDWARE",
    "MatmulModel",
    "float32_once",
    "implicit_gemm",
    "names",
    "resolve",
]

#: ``(lhs, rhs, dot_general params, result dtype) -> result``: operands hold values of the
#: program's (or policy's) 8- or 16-bit format, in that dtype where the program's operand is
#: float32 (a float32 program under a 16-bit policy); emulate rounds the result to its target.
MatmulModel = Callable[[jax.Array, jax.Array, dict[str, Any], Any], jax.Array]

_NARROW = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def float32_once(
    lhs: jax.Array, rhs: jax.Array, params: dict[str, Any], out_dtype: Any
) -> jax.Array:
    """``dot_general`` with float32 accumulation, returned in ``out_dtype`` (rounded once)."""
    out = lax.dot_general(
        lhs.astype(jnp.promote_types(lhs.dtype, jnp.float32)),
        rhs.astype(jnp.promote_types(rhs.dtype, jnp.float32)),
        params["dimension_numbers"],
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.promote_types(out_dtype, jnp.float32),
    )
    return out.astype(out_dtype)


def implicit_gemm(
    model: MatmulModel, lhs: jax.Array, rhs: jax.Array, params: dict[str, Any], out_dtype: Any
) -> jax.Array:
    """A ``conv_general_dilated`` (its equation's ``params``) as the GEMM over its patches,
    computed by ``model``: (G, M, K) patches times (G, O_g, K) kernel rows, batched over the
    groups; the result in the convolution's layout and ``out_dtype``."""
    plan = from_params(lhs.shape, rhs.shape, params)
    gemm_params = {
        "dimension_numbers": BATCHED_GEMM_DIMS,
        "precision": None,
        "preferred_element_type": None,
    }
    y = model(plan.patches(lhs), plan.kernel_rows(rhs), gemm_params, out_dtype)
    return plan.output(y)


def _narrow_pair(lhs: jax.Array, rhs: jax.Array) -> bool:
    ln, rn = jnp.dtype(lhs.dtype).name, jnp.dtype(rhs.dtype).name
    if ln not in _NARROW or rn not in _NARROW:
        return False
    eight = ("float8" in ln) and ("float8" in rn)
    return eight or ln == rn


def _tensor_core(
    lhs: jax.Array, rhs: jax.Array, params: dict[str, Any], out_dtype: Any, *, preset: str
) -> jax.Array:
    if not _narrow_pair(lhs, rhs):
        return float32_once(lhs, rhs, params, out_dtype)
    dn = params["dimension_numbers"]
    y = hardware.dot_general(lhs, rhs, dn, preset=preset, out_dtype=jnp.float32)
    return y.astype(out_dtype)


#: emulate's default matmul model: XLA on an H100 (a preset of precisionlab.hardware)
DEFAULT = "h100-xla"

#: emulate's own names; every preset and alias of ``hardware`` is accepted too.
HARDWARE: dict[str, MatmulModel] = {"float32": float32_once}


def names() -> tuple[str, ...]:
    """Every name ``hardware=`` accepts (the default first)."""
    rest = [p for p in (*hardware.PRESETS, *hardware.PRESET_ALIASES) if p != DEFAULT]
    return (DEFAULT, *HARDWARE, *rest)


def resolve(name: str | MatmulModel) -> MatmulModel:
    """The matmul model ``name`` (see the module docstring), or a callable one."""
    if callable(name):
        return name
    if isinstance(name, str) and name in HARDWARE:
        return HARDWARE[name]
    if isinstance(name, str) and name in hardware.AMBIGUOUS_PRESETS:
        hardware.canonical_preset(name)  # raises, naming the choices
    if isinstance(name, str) and name in names():
        return partial(_tensor_core, preset=hardware.canonical_preset(name))
    raise ValueError(
        f"hardware must be one of {', '.join(names())} or a callable "
        f"(lhs, rhs, dot_general params, dtype) -> array; got {name!r}"
    )
