"""Experiments: TOML configs, the runner and run store, reports and comparisons.

``precisionlab run CONFIG`` -> :func:`run_file`; ``--resume DIR`` -> :func:`resume`;
``precisionlab report DIR`` -> :func:`write_report` (:func:`load_run` reads a run directory,
:func:`summary_table` prints its table); ``precisionlab compare`` -> :func:`compare_runs`.

Names are imported on first use (PEP 562): a module of this package that needs no JAX (the
run store, the report's figures, drawn in worker processes) is imported without it.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

__all__ = [
    "ConfigError",
    "Experiment",
    "Unit",
    "compare_runs",
    "load_experiment",
    "load_run",
    "resume",
    "run_file",
    "summary_table",
    "write_report",
]


def __getattr__(name: str) -> Any:
    home: ModuleType
    if name == "compare_runs":
        import precisionlab.experiments._compare as home
    elif name in ("ConfigError", "Experiment", "Unit", "load_experiment"):
        import precisionlab.experiments._config as home
    elif name in ("load_run", "summary_table", "write_report"):
        import precisionlab.experiments._report as home
    elif name in ("resume", "run_file"):
        import precisionlab.experiments._runner as home
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(home, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
