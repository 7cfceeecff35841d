"""The hooks that add fields to a step's record: what the loop measures every N steps.

Each is an object with ``due(step) -> bool`` and one method the loop calls when it is due; the
loop writes what that method returns into the step's record (a dict of plain values) and folds
it into the run's :class:`~precisionlab.train._aggregates.Aggregates` with ``fold``. Three
kinds, by what they read:

- :class:`MeasureHook` (``measure(step, state, batch)``), before a compiled call, on the state
  that call starts from (``step``: steps done): :class:`ProbeHook` (histograms of log2|grad|
  and of the activations, the float32 shadow comparison), :class:`RecipeMetricsHook`;
- :class:`RowHook` (``row(step, value, aggregates)``), for every step, from what the compiled
  step returned (``step``: the 0-based index of the step): :class:`TelemetryRowHook`,
  :class:`PredictorRowHook`, :class:`LrHook`;
- :class:`EvalHook` (``evaluate(params)``), after a step (``step``: steps done), on the state
  after it; the loop also runs it after the last step.

Their fields land in the step's record in the order the loop lists them, as before they were
hooks (the golden runs of tests/test_train_golden_bits.py pin the bits).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax
import numpy as np

from precisionlab.train._aggregates import Aggregates
from precisionlab.train._meters import hist_edges
from precisionlab.train._predictors import Predictors, predictor_row
from precisionlab.train._recipe_metrics import recipe_metrics
from precisionlab.train._step import TrainState
from precisionlab.train._telemetry import Telemetry, telemetry_rows

__all__ = [
    "EvalHook",
    "LrHook",
    "MeasureHook",
    "PredictorRowHook",
    "ProbeHook",
    "RecipeMetricsHook",
    "RowHook",
    "TelemetryRowHook",
]


def _every(interval: int, step: int) -> bool:
    return bool(interval) and step % interval == 0


class MeasureHook(Protocol):
    """Measures the state a compiled call starts from; fields go into that call's first step."""

    def due(self, step: int) -> bool: ...

    def measure(self, step: int, state: TrainState, batch: Any) -> dict[str, Any]: ...

    def fold(self, aggregates: Aggregates) -> Aggregates: ...


class RowHook(Protocol):
    """Turns what the compiled step returned under ``source`` (a metrics key, or None) into
    fields of the step's record."""

    source: str | None

    def due(self, step: int) -> bool: ...

    def row(self, step: int, value: Any, aggregates: Aggregates) -> dict[str, Any]: ...


def _hist_dict(h: dict[str, Any] | None) -> dict[str, Any] | None:
    if h is None:
        return None
    return {
        "edges": hist_edges().tolist(),
        "counts": np.asarray(h["counts"]).tolist(),
        "zeros": int(h["zeros"]),
        "nonfinite": int(h["nonfinite"]),
    }


class ProbeHook:
    """Every ``hist_interval`` steps: ``grad_hist`` and ``act_hist`` (log2 histograms); every
    ``hist_interval`` or ``shadow_interval`` steps, with a shadow loss: ``shadow_cosine`` and
    ``shadow_underflow_lost``. ``probe(state, batch)`` is the jitted
    :func:`~precisionlab.train._step.make_probe_fn`."""

    def __init__(
        self,
        probe: Callable[[TrainState, Any], dict[str, Any]],
        hist_interval: int,
        shadow_interval: int | None,
    ) -> None:
        """``shadow_interval``: None without a shadow loss (0: only with the histograms)."""
        self.probe, self.hist_interval, self.shadow_interval = probe, hist_interval, shadow_interval

    def due(self, step: int) -> bool:
        hist = _every(self.hist_interval, step)
        shadow = self.shadow_interval is not None and _every(self.shadow_interval, step)
        return hist or shadow

    def measure(self, step: int, state: TrainState, batch: Any) -> dict[str, Any]:
        out = jax.device_get(self.probe(state, batch))
        rec: dict[str, Any] = {}
        if _every(self.hist_interval, step):
            rec["grad_hist"] = _hist_dict(out["grad_hist"])
            rec["act_hist"] = _hist_dict(out["act_hist"])
        if "shadow_cosine" in out:
            rec["shadow_cosine"] = float(out["shadow_cosine"])
            rec["shadow_underflow_lost"] = float(out["shadow_underflow_lost"])
        return rec

    def fold(self, aggregates: Aggregates) -> Aggregates:
        return aggregates


class RecipeMetricsHook:
    """Every ``interval`` steps, the recipe's error metrics per GEMM group
    (``recipe_{group}_{stat}``, see :mod:`precisionlab.train._recipe_metrics`), averaged into
    the run's ``recipe_metrics``. ``probe(state, batch)`` computes their device values."""

    def __init__(self, probe: Callable[[TrainState, Any], Any], interval: int) -> None:
        self.probe, self.interval = probe, interval
        self.last: dict[str, dict[str, float]] = {}

    def due(self, step: int) -> bool:
        return _every(self.interval, step)

    def measure(self, step: int, state: TrainState, batch: Any) -> dict[str, Any]:
        self.last = recipe_metrics(self.probe(state, batch))
        rec: dict[str, Any] = {}
        for group, stats in self.last.items():
            rec.update({f"recipe_{group}_{k}": v for k, v in stats.items()})
        return rec

    def fold(self, aggregates: Aggregates) -> Aggregates:
        return aggregates.with_recipe_metrics(self.last)


class PredictorRowHook:
    """``predictors``: the per-layer divergence predictors the step computed, on due steps."""

    source: str | None = "predictors"

    def __init__(self, predictors: Predictors) -> None:
        self.predictors = predictors

    def due(self, step: int) -> bool:
        return bool(self.predictors.due(step))

    def row(self, step: int, value: Any, aggregates: Aggregates) -> dict[str, Any]:
        return {} if value is None else {"predictors": predictor_row(value, step + 1)}


class TelemetryRowHook:
    """``telemetry``: one row per layer and tensor of the step's statistics, on due steps.
    ``names`` is the step's map of matmul names (filled when it is traced)."""

    source: str | None = "telemetry"

    def __init__(self, telemetry: Telemetry, names: dict[str, Any]) -> None:
        self.telemetry, self.names = telemetry, names

    def due(self, step: int) -> bool:
        return bool(self.telemetry.due(step))

    def row(self, step: int, value: Any, aggregates: Aggregates) -> dict[str, Any]:
        if value is None:
            return {}
        return {"telemetry": telemetry_rows(value, self.names, step + 1, self.telemetry.targets)}


class LrHook:
    """``lr``: the rate the step applied. optax counts applied updates only, so the schedule is
    read at the step's index less the steps skipped before it."""

    source: str | None = None

    def __init__(self, schedule: Callable[[int], Any]) -> None:
        self.schedule = schedule

    def due(self, step: int) -> bool:
        return True

    def row(self, step: int, value: Any, aggregates: Aggregates) -> dict[str, Any]:
        return {"lr": float(self.schedule(step - aggregates.skipped_steps))}


class EvalHook:
    """``eval_fn(params) -> {"eval_loss", "eval_metric"}`` every ``interval`` steps (0: none
    but the last), recorded in the step's record and in the run's ``evals``."""

    def __init__(self, eval_fn: Callable[[Any], dict[str, float]], interval: int) -> None:
        self.eval_fn, self.interval = eval_fn, interval

    def due(self, step: int) -> bool:
        return _every(self.interval, step)

    def evaluate(self, params: Any) -> dict[str, float]:
        return self.eval_fn(params)

    def fold(self, aggregates: Aggregates, step: int, fields: dict[str, float]) -> Aggregates:
        return aggregates.with_eval(step, fields)
