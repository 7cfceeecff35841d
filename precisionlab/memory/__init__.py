"""Memory accounting: where the bytes of a training step go under a precision policy.

- :func:`estimate` (a transformer described by :class:`ModelSpec`, e.g. a GPT-3 preset from
  :func:`get_preset`, trained with a :class:`TrainSetup`) -> :class:`Breakdown` in bytes.
- :func:`estimate_step` (a params pytree, a batch and saved activation bytes) -> the argument,
  output and temporary sizes XLA should report for a jitted train step;
  :func:`measure` reads what XLA reports (``memory_analysis``, ``cost_analysis``,
  ``memory_stats``).
- :func:`fit`: does it fit a budget, and the smallest change that makes it fit.
- :func:`parse_size` / :func:`format_size`: "80GiB" <-> bytes (GB = 1e9, GiB = 2**30).
"""

from precisionlab.memory._estimate import (
    OPTIMIZERS,
    Breakdown,
    ModelSpec,
    StepEstimate,
    TrainSetup,
    best_checkpoint_interval,
    estimate,
    estimate_step,
    layer_activation_bytes,
    tree_bytes,
)
from precisionlab.memory._fit import FitResult, fit
from precisionlab.memory._measure import Measured, compare_rows, measure, time_step
from precisionlab.memory._presets import PRESETS, get_preset, preset_names
from precisionlab.memory._units import UNITS, format_size, parse_size

__all__ = [
    "OPTIMIZERS",
    "PRESETS",
    "UNITS",
    "Breakdown",
    "FitResult",
    "Measured",
    "ModelSpec",
    "StepEstimate",
    "TrainSetup",
    "best_checkpoint_interval",
    "compare_rows",
    "estimate",
    "estimate_step",
    "fit",
    "format_size",
    "get_preset",
    "layer_activation_bytes",
    "measure",
    "parse_size",
    "preset_names",
    "time_step",
    "tree_bytes",
]
