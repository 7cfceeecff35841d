"""Numerics telemetry inside ``jit``: where a run's precision breaks.

- :func:`tensor_stats`: amax, smallest nonzero magnitude, dynamic range, mean, std, zeros,
  non-finites, and for each target format or recipe (``"e4m3"``, ``"e4m3:tensor"``,
  ``"bf16"``, ``"mxfp8"``, ...) the fractions that would overflow, saturate, underflow or
  land in subnormals and the SQNR of the quantized copy; :func:`derive` / :func:`to_dict`
  finish them, :func:`combine` / :func:`reduce_over` merge shards exactly;
  :func:`stacked_stats` / :func:`stats_of_many`: many tensors in one small program.
- :func:`observe`: any JAX function with statistics of every matmul's operands, output and
  (with :meth:`Observed.value_and_grad`) output cotangent, and of every other operation that
  can overflow or underflow (``ops=OPS``: powers, exponentials, products, sums, casts ...),
  keyed by the interception site names of :mod:`precisionlab.intercept`; :func:`tree_stats`
  for params, grads, optimizer state.
- :func:`every`: compute statistics only every N steps (``lax.cond``).

``observe`` and ``tree_stats`` compute the statistics of all their tensors together
(:func:`stacked_stats`) and return a :class:`StatsTable`, read like a dict.
"""

from precisionlab.telemetry._observe import (
    OPS,
    Observed,
    ObservedGrad,
    StatsTable,
    every,
    observe,
    tree_stats,
)
from precisionlab.telemetry._stats import (
    TensorStats,
    combine,
    derive,
    reduce_over,
    stacked_stats,
    stats_of_many,
    tensor_stats,
    to_dict,
)
from precisionlab.telemetry._targets import SCALINGS, Target, parse_targets

__all__ = [
    "OPS",
    "SCALINGS",
    "Observed",
    "ObservedGrad",
    "StatsTable",
    "Target",
    "TensorStats",
    "combine",
    "derive",
    "every",
    "observe",
    "parse_targets",
    "reduce_over",
    "stacked_stats",
    "stats_of_many",
    "tensor_stats",
    "to_dict",
    "tree_stats",
]
