"""Exact per-operation numerics for any JAX model.

:func:`emulate` turns a function (a Flax linen/NNX or Equinox model, a loss over a plain pytree)
into one that computes what XLA's GPU backend computes: every floating-point operation's result
rounded to the dtype the program gives it (a float32 program under a 16-bit policy: the
policy's compute format; a 16-bit program's own float32 upcasts kept), transcendental functions
correctly rounded, XLA's constant folding (``x * 1000 / 1000`` is x) applied, matmuls through a
pluggable model (``hardware=``; default the H100's tensor cores as XLA drives them), and
the backward pass rounded at the same points. A CPU run then shows the overflow and
underflow a GPU run would, where XLA's CPU lowering would otherwise keep float32 between
fused operations.
:func:`check` lists, per operation, where a native run and an emulated one differ, and ranks
the operations by their share of the output's difference; :func:`attribute` does that for any
two ways of computing a function (:class:`Side`: as written, a policy, an emulate model, a
recipe).
Built on :mod:`precisionlab.intercept` and the rounding of
:mod:`precisionlab.mixed._numerics` (the built-in models' forced numerics).
"""

from precisionlab.emulate._attribution import Attribution, OpAttribution, Side, attribute
from precisionlab.emulate._check import CheckReport, OpDiff, check
from precisionlab.emulate._emulate import Emulated, emulate

__all__ = [
    "Attribution",
    "CheckReport",
    "Emulated",
    "OpAttribution",
    "OpDiff",
    "Side",
    "attribute",
    "check",
    "emulate",
]
