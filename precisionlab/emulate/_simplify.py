"""XLA's algebraic simplifications of constant arithmetic, as XLA:GPU applies them to a 16-bit
program before rounding anything (checked on an H100, jax 0.11.2, against the captures in
tests/data/h100_emulate.npz, whose README says where they and the compiled HLO came from):

- ``a / c`` becomes ``a * (1/c)``, the reciprocal rounded to the operation's dtype
  (``x * 1000`` behind an optimization_barrier, then ``/ 1000``: a multiply by float16
  0.0010004);
- ``(a * c1) * c2`` becomes ``a * (c1*c2)`` and ``(a * c1) / c2`` becomes ``a * (c1 * (1/c2))``,
  the constant folded in the dtype; a product of 1 leaves ``a`` (``x * 1000 / 1000`` returns x
  in float16 and bfloat16);
- ``(a + c1) - c2`` becomes ``a + (c1 - c2)``, and ``a + 0`` leaves ``a``.

Only literal scalar constants of the program are folded (what JAX writes for ``x * 1000``),
in the forward pass. :class:`Folds` records, by the identity of a traced value, how it was
made from a constant, so that the next operation can fold.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from precisionlab.intercept import _boundary as boundary

__all__ = ["Folds"]


@dataclasses.dataclass
class Folds:
    """Traced values known to be ``base * c`` (kind :data:`~precisionlab.intercept._boundary.MUL`)
    or ``base + c`` (kind :data:`~precisionlab.intercept._boundary.ADD`)."""

    made: dict[int, tuple[str, Any, float, Any]] = dataclasses.field(default_factory=dict)

    def note(self, out: Any, kind: str, base: Any, c: float) -> None:
        # the entry keeps ``out`` alive so that its id stays unique while the trace runs
        self.made[id(out)] = (kind, base, c, out)

    def of(self, x: Any) -> tuple[str, Any, float] | None:
        got = self.made.get(id(x))
        return None if got is None else got[:3]

    def clear(self) -> None:
        self.made.clear()


def constant(value: Any) -> float | None:
    """The float of a scalar literal operand, else None."""
    arr = np.asarray(value)
    if arr.size != 1 or not jnp.issubdtype(arr.dtype, jnp.floating):
        return None
    return float(arr.reshape(()))


def fold(op: str, c1: float, c2: float, dtype: Any) -> float:
    """The constant XLA folds for ``op`` (``boundary.MUL``: c1*c2, ``boundary.ADD``: c1+c2),
    rounded to ``dtype``."""
    dt = np.dtype(dtype)
    a, b = np.asarray(c1, dt), np.asarray(c2, dt)
    with np.errstate(all="ignore"):
        out = a * b if op == boundary.MUL else a + b
    return float(np.asarray(out, dt))


def reciprocal(c: float, dtype: Any) -> float:
    """``1/c`` rounded to ``dtype`` (the constant XLA multiplies by instead of dividing)."""
    dt = np.dtype(dtype)
    with np.errstate(all="ignore"):
        return float(np.asarray(np.asarray(1.0, dt) / np.asarray(c, dt), dt))
