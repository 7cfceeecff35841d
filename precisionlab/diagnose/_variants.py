"""Pick the variants a diagnosis runs from an experiment file, and check they are comparable."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from precisionlab.experiments._config import Experiment, Unit, load_experiment
from precisionlab.train import TrainConfig
from precisionlab.train._models import layer_names, resolve_layers

__all__ = ["SHARED_KEYS", "check", "load_units", "pick", "with_layers_high"]

#: What two variants must share to be compared or bisected: the model, the data and their order.
SHARED_KEYS: tuple[str, ...] = (
    "model",
    "model_kwargs",
    "data",
    "data_kwargs",
    "batch_size",
    "seed",
)


def pick(experiment: Experiment, name: str) -> Unit:
    """The unit called ``name``: its full name (``"underflow/fp16-noscale"``) or, when it is
    unique, its variant name; ValueError listing the names otherwise."""
    units = experiment.units
    if not units:
        raise ValueError(f"{experiment.source}: a {experiment.kind!r} experiment has no variants")
    exact = [u for u in units if u.name == name]
    if exact:
        return exact[0]
    by_variant = [u for u in units if u.variant == name]
    if len(by_variant) == 1:
        return by_variant[0]
    names = ", ".join(u.name for u in units)
    if by_variant:
        raise ValueError(f"variant {name!r} runs in several settings; name one of: {names}")
    raise ValueError(f"unknown variant {name!r} in {experiment.source}; variants: {names}")


def _check_shared(a: Unit, b: Unit) -> None:
    ca, cb = a.config, b.config
    for key in SHARED_KEYS:
        va, vb = getattr(ca, key), getattr(cb, key)
        if va != vb:
            raise ValueError(
                f"variants {a.name!r} and {b.name!r} do not share {key} ({va!r} vs {vb!r}): "
                "a diagnosis compares precisions of one model on one data order"
            )


def load_units(
    path: str | Path, names: Sequence[str], overrides: Sequence[str] = ()
) -> tuple[Experiment, list[Unit]]:
    """The experiment at ``path`` (with ``--set`` overrides) and its units ``names``, checked to
    share model, data, batch size and seed."""
    experiment = load_experiment(path, overrides)
    if experiment.kind != "train":
        raise ValueError(
            f"{path}: diagnose needs a 'train' experiment, got kind {experiment.kind!r}"
        )
    units = [pick(experiment, n) for n in names]
    for other in units[1:]:
        _check_shared(units[0], other)
    return experiment, units


def with_layers_high(config: TrainConfig, layers: Sequence[str], **changes: Any) -> TrainConfig:
    """``config`` with ``layers`` (names) added to its high-precision layers."""
    hp = tuple(dict.fromkeys((*config.high_precision_layers, *layers)))
    return dataclasses.replace(config, high_precision_layers=hp, **changes)


def check(mode: str, units: Sequence[Unit], options: object) -> None:
    """The errors a diagnosis would meet later, raised before any run: a ``--layers`` pattern
    matching no layer (bisect), stacked layers (bisect: it returns single layers to high
    precision, which stacked identical layers cannot), a variant without a recipe
    (autoswitch)."""
    cfg = units[0].config
    layers = getattr(options, "layers", ())
    stacked = [u.name for u in units if u.config.scan_layers]
    if mode == "bisect" and stacked:
        raise ValueError(
            f"--bisect returns single layers to high precision, but {stacked[0]!r} stacks its "
            "layers (scan_layers = true): run it with --set train.scan_layers=false"
        )
    if mode == "bisect" and layers:
        resolve_layers(layers, layer_names(cfg.model, cfg.model_kwargs), "--layers pattern")
    if mode == "autoswitch" and cfg.precision.recipe is None:
        raise ValueError(
            f"variant {units[0].name!r} has no recipe: --autoswitch switches a recipe's "
            "matmuls to high precision"
        )
