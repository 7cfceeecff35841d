"""The ``train`` experiment kind, built on :func:`precisionlab.train.train`.

A ``[train]`` table maps one to one onto :class:`precisionlab.train.TrainConfig`: its keys,
types, defaults and ranges are the trainer's own field table
(:data:`precisionlab.train._config.TRAIN_FIELDS`), so every knob of the trainer can be set from
an experiment file and is validated once, by the config itself, before any training starts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from precisionlab._schema import ConfigError, Field
from precisionlab.experiments import _store as store
from precisionlab.train import Hook, TrainConfig, make_data, make_model, train
from precisionlab.train._compose import precompile as _compile_ahead
from precisionlab.train._config import TRAIN_FIELDS
from precisionlab.train._forecast import ForecastHook
from precisionlab.train._predictors import PredictorHook, parse_predictors, run_meta
from precisionlab.train._timing import LoopTimings

__all__ = ["KIND", "config", "metric_row", "precompile", "run_unit", "schema", "validate"]

KIND = "train"


def schema() -> dict[str, Field]:
    """``[train]`` keys -> fields (the trainer's :data:`TRAIN_FIELDS`)."""
    return dict(TRAIN_FIELDS)


def config(table: dict[str, Any], where: str) -> TrainConfig:
    """A ``[train]`` table as a validated :class:`TrainConfig` (one ConfigError line naming
    ``where.key`` otherwise); model and data options are checked by building their (cheap)
    descriptions, so a bad ``model_kwargs`` / ``data_kwargs`` key fails now, not when its
    variant starts."""
    if "telemetry" not in table:  # on by default in experiments (``{enabled = false}``: off)
        table = {**table, "telemetry": {}}
    try:
        cfg = TrainConfig.from_dict(table, where)
    except (ValueError, TypeError) as err:
        message = str(err).splitlines()[0]
        raise ConfigError(message if message.startswith(where) else f"{where}: {message}") from None
    for key, build, name, kwargs in (
        ("data_kwargs", make_data, cfg.data, cfg.data_kwargs),
        ("model_kwargs", make_model, cfg.model, cfg.model_kwargs),
    ):
        try:
            build(name, **kwargs)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"{where}.{key}: {str(err).splitlines()[0]}") from None
    return cfg


def validate(table: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``[train]`` table validated, with every default filled in (JSON-able)."""
    return config(table, where).to_dict()


def _scalar(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "size", 1) == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


_HIST_KEYS = ("grad_hist", "act_hist")


def metric_row(metrics: dict[str, Any]) -> dict[str, Any]:
    """One trainer metrics dict as a flat JSON row; histograms and other array-valued entries
    are left out (histograms go to ``hist.jsonl``)."""
    row = {}
    for key, value in metrics.items():
        if key in _HIST_KEYS or key == "telemetry" or isinstance(value, dict):
            continue
        if isinstance(value, list | tuple):
            row[key] = [str(v) for v in value]
            continue
        size = getattr(value, "size", None)
        if size is not None and size != 1:
            continue
        row[key] = _scalar(value)
    return row


def run_unit(
    cfg: TrainConfig,
    unit_dir: Path,
    *,
    on_step: Callable[[dict[str, Any]], None],
    on_hist: Callable[[dict[str, Any]], None],
    on_telemetry: Callable[[list[dict[str, Any]]], None] | None = None,
    resume: bool,
    quiet: bool,
    label: str = "",
    hooks: Sequence[Hook] = (),
    timings: LoopTimings | None = None,
) -> dict[str, Any]:
    """Train one unit; every step's metrics go to ``on_step``, histograms to ``on_hist``,
    telemetry rows (a list per telemetry step) to ``on_telemetry``, then ``hooks`` run (the
    runner's progress bar). ``label`` names the unit (for messages); ``timings`` receives where
    the loop's time went.

    Returns the JSON-able final result (eval loss and metric, divergence, ...).
    """

    def callback(metrics: dict[str, Any]) -> None:
        on_step(metric_row(metrics))  # first: the runner starts (or trims, on resume) its files
        hists = {k: metrics[k] for k in _HIST_KEYS if k in metrics}
        if hists:
            on_hist({"step": metrics.get("step"), **hists})
        if on_telemetry is not None and metrics.get("telemetry"):
            on_telemetry(metrics["telemetry"])  # one row per layer and tensor

    # What the unit trains on (the text corpus's file list and content hash, the digits split,
    # a generated set's options), so runs on different machines can be compared.
    store.write_json(
        Path(unit_dir) / "data.json", make_data(cfg.data, **cfg.data_kwargs).describe()
    )
    checkpoints = Path(unit_dir) / "checkpoints" if cfg.checkpoint_interval else None
    extra, closers = _predictor_hooks(cfg, Path(unit_dir), label or Path(unit_dir).name, resume)
    try:
        result = train(
            cfg,
            callback=callback,
            checkpoint_dir=checkpoints,
            resume=resume,
            quiet=quiet,
            hooks=(*extra, *hooks),
            timings=timings,
        )
    finally:
        for close in closers:
            close()
    out = {k: _scalar(v) if not isinstance(v, list) else v for k, v in result.summary().items()}
    out["loss_weight"] = cfg.loss_weight  # the recorded losses are the plain (unweighted) loss
    out["eval_metric_name"] = "accuracy"  # both built-in models report (token) accuracy
    return out


def _predictor_hooks(
    cfg: TrainConfig, unit_dir: Path, label: str, resume: bool
) -> tuple[list[Hook], list[Callable[[], None]]]:
    """With ``[train.predictors]``: a hook writing ``predictors.jsonl`` (one row per record,
    see :mod:`precisionlab.train._predictors`; a resumed unit's rows after its checkpoint are
    dropped first) and, with ``live = true``, the live forecaster printing its alarm."""
    pred = parse_predictors(cfg.predictors, cfg.steps)
    if pred is None:
        return [], []
    prec = cfg.precision
    meta = run_meta(prec.policy, prec.storage.param_dtype(prec.policy.param_dtype), prec.recipe)
    path = unit_dir / "predictors.jsonl"
    if not resume:
        path.unlink(missing_ok=True)
    writer: list[store.JsonlWriter] = []

    def write(row: dict[str, Any]) -> None:
        if not writer:
            store.resume_jsonl(path, int(row["step"]))  # rows of a killed run's later steps
            writer.append(store.JsonlWriter(path))
        writer[0].write(row)

    hooks: list[Hook] = [PredictorHook(write, meta)]
    if pred.live:
        hooks.append(ForecastHook(meta, label=label))
    return hooks, [lambda: writer[0].close() if writer else None]


def precompile(cfg: TrainConfig) -> None:
    """Compile the programs :func:`run_unit` will run for ``cfg`` (see
    :func:`precisionlab.train._compose.precompile`): the runner calls it in a thread for the
    next unit while the current one trains."""
    _compile_ahead(cfg)
