"""``precisionlab diagnose``: find the layer and step where a run's precision breaks.

On experiment variants (``precisionlab diagnose``) and on any JAX function
(``compare(fn, args, reference="fp32", candidate="c=f16")``, ``bisect(fn, args, ...)``,
``autoswitch(fn, args, recipe=...)``: :mod:`precisionlab.diagnose._function`).

- :func:`compare`: two variants of an experiment in lockstep (same batches and seeds), every
  intercepted tensor compared per step; the first break, explained by its statistics.
- :func:`bisect`: the smallest set of layers whose return to high precision
  (``TrainConfig.high_precision_layers``) makes a failing variant pass.
- :func:`autoswitch`: a recipe variant whose matmuls switch to high precision inside ``jit``
  when their underflow or quantization MSE exceeds a threshold.
- :func:`run_forecast`: the divergence forecaster over a run directory's recorded predictors
  (alarms per unit; on a suite, precision, recall and lead against kurtosis alone and TE's
  thresholds), :func:`fit_forecaster` its rules' thresholds, :func:`write_forecast` the
  report, :func:`forecast_command` all of ``diagnose --forecast`` (its :class:`ForecastOptions`).

:func:`load_units` picks the variants from an experiment file and checks they share model and
data; the ``write_*`` functions put a report into a run directory.
"""

from precisionlab.diagnose._autoswitch import AutoSwitchRecipe, SwitchOptions, SwitchResult
from precisionlab.diagnose._bisect import BisectOptions, BisectResult, BisectRun, run_budget
from precisionlab.diagnose._compare import (
    CompareOptions,
    CompareResult,
    Crossing,
    match_tensors,
    relative_difference,
)
from precisionlab.diagnose._forecast import fit as fit_forecaster
from precisionlab.diagnose._forecast import run_forecast
from precisionlab.diagnose._forecast_run import ForecastOptions, forecast_command, write_forecast
from precisionlab.diagnose._function import (
    FunctionBisect,
    FunctionComparison,
    autoswitch,
    bisect,
    compare,
)
from precisionlab.diagnose._report import open_run, write_autoswitch, write_bisect, write_compare
from precisionlab.diagnose._variants import check, load_units, pick

__all__ = [
    "AutoSwitchRecipe",
    "BisectOptions",
    "BisectResult",
    "BisectRun",
    "CompareOptions",
    "CompareResult",
    "Crossing",
    "ForecastOptions",
    "FunctionBisect",
    "FunctionComparison",
    "SwitchOptions",
    "SwitchResult",
    "autoswitch",
    "bisect",
    "check",
    "compare",
    "fit_forecaster",
    "forecast_command",
    "load_units",
    "match_tensors",
    "open_run",
    "pick",
    "relative_difference",
    "run_budget",
    "run_forecast",
    "write_autoswitch",
    "write_bisect",
    "write_compare",
    "write_forecast",
]
