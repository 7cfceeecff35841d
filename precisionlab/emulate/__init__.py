"""Exact per-operation numerics for any JAX model.

:func:`emulate` turns a function (a Flax linen/NNX or Equinox model, a loss over a plain pytree)
into one whose every floating-point operation takes operands and returns a result rounded to a
policy's compute format, as 16-bit hardware computes: matmuls and convolutions accumulate in
float32 and round once, and the backward pass is rounded at the same points. A CPU run then shows
the overflow and underflow a GPU run would, where XLA's CPU lowering would otherwise keep float32
between fused operations. Built on :mod:`precisionlab.intercept` and the rounding of
:mod:`precisionlab.mixed.numerics` (the built-in models' forced numerics).
"""

from precisionlab.emulate._check import CheckReport, OpDiff, check
from precisionlab.emulate._emulate import Emulated, emulate

__all__ = ["CheckReport", "Emulated", "OpDiff", "check", "emulate"]
