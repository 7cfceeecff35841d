"""Experiments: TOML configs, the runner and run store, reports and comparisons.

``precisionlab run CONFIG`` -> :func:`run_file`; ``--resume DIR`` -> :func:`resume`;
``precisionlab report DIR`` -> :func:`write_report`; ``precisionlab compare`` ->
:func:`compare_runs`.
"""

from precisionlab.experiments.compare import compare_runs
from precisionlab.experiments.config import ConfigError, Experiment, Unit, load_experiment
from precisionlab.experiments.report import write_report
from precisionlab.experiments.runner import resume, run_file

__all__ = [
    "ConfigError",
    "Experiment",
    "Unit",
    "compare_runs",
    "load_experiment",
    "resume",
    "run_file",
    "write_report",
]
