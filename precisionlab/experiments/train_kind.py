"""The ``train`` experiment kind, built on :func:`precisionlab.train.train`.

A ``[train]`` table maps one to one onto :class:`precisionlab.train.TrainConfig`: its keys,
types and defaults are read from that dataclass, so every knob of the trainer can be set from
an experiment file. Names (model, data, optimizer, schedule, update rounding, policy, loss
scale) are checked here with the allowed values in the message, then the trainer's own
validation runs, all before any training starts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from precisionlab.experiments.schema import ConfigError, Field, validate_table

__all__ = ["KIND", "metric_row", "run_unit", "schema", "validate"]

KIND = "train"


def _names(attr: str) -> Callable[[], tuple[str, ...]] | None:
    def get() -> tuple[str, ...]:
        import precisionlab.train as train

        return tuple(getattr(train, attr))

    return get


def _check_policy(text: str) -> str:
    from precisionlab.mixed.policy import get_policy

    get_policy(text)
    return text


def _check_loss_scale(text: str) -> str:
    from precisionlab.mixed.loss_scale import parse_loss_scale

    parse_loss_scale(text)
    return text


def _check_loss_weight(value: float) -> float:
    from precisionlab.train.config import check_loss_weight

    return check_loss_weight(value)


def _check_dtype(text: str) -> str:
    from precisionlab.mixed.policy import parse_dtype

    parse_dtype(text)
    return text


def _field_type(annotation: str) -> tuple[type, type | None]:
    ann = annotation.replace(" ", "")
    if ann.startswith("dict"):
        return dict, None
    if ann.startswith(("tuple[str", "list[str")):
        return list, str
    for name, kind in (("float", float), ("int", int), ("bool", bool), ("str", str)):
        if ann.startswith(name):
            return kind, None
    raise TypeError(f"TrainConfig field type {annotation!r} has no TOML mapping")


_CHOICES = {
    "model": "MODELS",
    "data": "DATASETS",
    "optimizer": "OPTIMIZERS",
    "schedule": "SCHEDULES",
}
_CHECKS = {
    "policy": _check_policy,
    "loss_scale": _check_loss_scale,
    "params_dtype": _check_dtype,
    "grads_dtype": _check_dtype,
    "allreduce_dtype": _check_dtype,
    "loss_weight": _check_loss_weight,
}


def schema() -> dict[str, Field]:
    """``[train]`` keys -> fields, derived from :class:`precisionlab.train.TrainConfig`."""
    from precisionlab.train.config import DIVERGENCE_ACTIONS, UPDATE_ROUNDINGS, TrainConfig

    out: dict[str, Field] = {}
    for f in dataclasses.fields(TrainConfig):
        kind, item = _field_type(str(f.type))
        if f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory()  # type: ignore[misc]
        if isinstance(default, tuple):
            default = list(default)
        choices: Any = None
        if f.name in _CHOICES:
            choices = _names(_CHOICES[f.name])
        elif f.name == "update_rounding":
            choices = UPDATE_ROUNDINGS
        elif f.name == "divergence_action":
            choices = DIVERGENCE_ACTIONS
        out[f.name] = Field(
            kind,
            default,
            choices=choices,
            check=_CHECKS.get(f.name),
            item=item,
            nullable="None" in str(f.type),
        )
    return out


def validate(table: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``[train]`` table checked against the schema and by ``TrainConfig`` itself; returns the
    table with every default filled in (JSON-able)."""
    resolved = validate_table(table, schema(), where)
    from precisionlab.train.config import TrainConfig

    try:
        config = TrainConfig.from_dict(resolved, where)
    except (ValueError, TypeError) as err:
        message = str(err).splitlines()[0]
        if not message.startswith(where):
            message = f"{where}: {message}"
        raise ConfigError(message) from None
    _check_builders(config, where)
    return config.to_dict()


def _check_builders(config: Any, where: str) -> None:
    """Build the model and data descriptions and the optimizer (cheap: no params are created)
    so that a bad ``model_kwargs`` / ``data_kwargs`` / ``optimizer_kwargs`` key fails now, not
    when its variant starts."""
    from precisionlab.train import make_data, make_model, make_optimizer

    def optimizer(name: str, **kwargs: Any) -> Any:
        return make_optimizer(name, config.lr, schedule=config.schedule, steps=config.steps,
                              warmup_steps=config.warmup_steps, **kwargs)  # fmt: skip

    for key, build, name, kwargs in (
        ("data_kwargs", make_data, config.data, config.data_kwargs),
        ("model_kwargs", make_model, config.model, config.model_kwargs),
        ("optimizer_kwargs", optimizer, config.optimizer, config.optimizer_kwargs),
    ):
        try:
            build(name, **kwargs)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"{where}.{key}: {str(err).splitlines()[0]}") from None


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
        if key in _HIST_KEYS or isinstance(value, dict):
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
    params: dict[str, Any],
    unit_dir: Path,
    *,
    on_step: Callable[[dict[str, Any]], None],
    on_hist: Callable[[dict[str, Any]], None],
    resume: bool,
    quiet: bool,
    label: str,
) -> dict[str, Any]:
    """Train one unit; every step's metrics go to ``on_step``, histograms to ``on_hist``.

    Returns the JSON-able final result (eval loss and metric, divergence, ...).
    """
    from precisionlab.train import TrainConfig, train

    table = dict(params)
    if quiet:
        table["progress"] = False
    config = TrainConfig.from_dict(table, label)

    def callback(metrics: dict[str, Any]) -> None:
        on_step(metric_row(metrics))  # first: the runner starts (or trims, on resume) its files
        hists = {k: metrics[k] for k in _HIST_KEYS if k in metrics}
        if hists:
            on_hist({"step": metrics.get("step"), **hists})

    checkpoints = Path(unit_dir) / "checkpoints" if config.checkpoint_interval else None
    result = train(
        config, callback=callback, checkpoint_dir=checkpoints, resume=resume, quiet=quiet
    )
    out = {k: _scalar(v) if not isinstance(v, list) else v for k, v in result.summary().items()}
    out["loss_weight"] = config.loss_weight  # the recorded losses are the plain (unweighted) loss
    out["eval_metric_name"] = "accuracy"  # both built-in models report (token) accuracy
    return out
