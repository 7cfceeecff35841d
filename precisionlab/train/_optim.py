"""Optimizer builder: an optax ``GradientTransformation`` from plain values."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import jax
import optax

from precisionlab._schema import FLOAT32_MAX, Field

__all__ = [
    "OPTIMIZERS",
    "OPTIMIZER_FIELDS",
    "SCHEDULES",
    "VALUE_KWARGS",
    "make_optimizer",
    "make_schedule",
    "optimizer_defaults",
]

#: The optax optimizers a config names.
OPTIMIZERS: tuple[str, ...] = ("sgd", "momentum", "adam", "adamw", "lion", "rmsprop")
#: ``optimizer_kwargs`` passed to the compiled step as arguments (float32 scalars in
#: ``TrainState.values``) rather than compiled in: optimizers differing only in them share a
#: program. The others (decay rates, flags) stay constants of the program.
VALUE_KWARGS: tuple[str, ...] = ("eps",)
#: The learning-rate schedules a config names.
SCHEDULES: tuple[str, ...] = ("constant", "cosine", "linear")

_DECAY = Field(float, low=0.0, high=1.0)  # a moving-average coefficient
_EPS = Field(float, low=0.0, high=FLOAT32_MAX, why="the float32 max")
_FLAG = Field(bool)
_MOMENTUM = Field(float, None, nullable=True, low=0.0, high=1.0)
_ADAM = {"b1": _DECAY, "b2": _DECAY, "eps": _EPS, "eps_root": _EPS, "nesterov": _FLAG}
#: ``optimizer_kwargs`` each optimizer accepts, with their types and ranges (the optax
#: constructor's keywords; dtype and mask options are not exposed).
OPTIMIZER_FIELDS: dict[str, dict[str, Field]] = {
    "sgd": {"momentum": _MOMENTUM, "nesterov": _FLAG},
    "momentum": {"momentum": _MOMENTUM, "nesterov": _FLAG},
    "adam": _ADAM,
    "adamw": _ADAM,
    "lion": {"b1": _DECAY, "b2": _DECAY},
    "rmsprop": {
        "decay": _DECAY,
        "eps": _EPS,
        "initial_scale": _EPS,
        "eps_in_sqrt": _FLAG,
        "centered": _FLAG,
        "momentum": _MOMENTUM,
        "nesterov": _FLAG,
        "bias_correction": _FLAG,
    },
}


def _constructor(name: str) -> Any:
    return {"momentum": optax.sgd}.get(name) or getattr(optax, name)


def optimizer_defaults(name: str, keys: Sequence[str]) -> dict[str, Any]:
    """The defaults of the optax constructor of optimizer ``name`` for those of ``keys`` it
    takes (e.g. ``{"eps": 1e-8}`` for adam, ``{}`` for sgd)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; allowed: {', '.join(OPTIMIZERS)}")
    params = inspect.signature(_constructor(name)).parameters
    return {k: params[k].default for k in keys if k in params}


def make_schedule(
    lr: float | jax.Array,
    schedule: str = "constant",
    *,
    steps: int | None = None,
    warmup_steps: int = 0,
) -> optax.Schedule:
    """Learning-rate schedule: linear warmup over ``warmup_steps`` then ``schedule`` (constant,
    cosine decay to 0 or linear decay to 0 at ``steps``)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; allowed: {', '.join(SCHEDULES)}")
    # a traced lr (an argument of the compiled step, see TrainState.values) is checked when given
    if not isinstance(lr, jax.Array) and not (isinstance(lr, int | float) and lr > 0):
        raise ValueError(f"lr must be a number > 0, got {lr!r}")
    if not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
    if schedule != "constant" and (steps is None or steps <= warmup_steps):
        raise ValueError(f"schedule {schedule!r} needs steps > warmup_steps, got steps={steps!r}")
    decay_steps = (steps or 0) - warmup_steps
    if schedule == "constant":
        main = optax.constant_schedule(lr)
    elif schedule == "cosine":
        main = optax.cosine_decay_schedule(lr, decay_steps)
    else:
        main = optax.linear_schedule(lr, 0.0, decay_steps)
    if warmup_steps == 0:
        return main
    return optax.join_schedules(
        [optax.linear_schedule(0.0, lr, warmup_steps), main], [warmup_steps]
    )


def make_optimizer(
    name: str,
    lr: float | jax.Array,
    *,
    schedule: str = "constant",
    steps: int | None = None,
    warmup_steps: int = 0,
    weight_decay: float = 0.0,
    grad_clip: float | None = None,
    **kwargs: Any,
) -> optax.GradientTransformation:
    """Build an optax optimizer by name (see :data:`OPTIMIZERS`).

    ``kwargs`` go to the optax constructor (e.g. ``b1``, ``b2``, ``eps`` for adam; ``momentum``
    for momentum, default 0.9). ``weight_decay`` is decoupled (adamw/lion natively, otherwise
    ``optax.add_decayed_weights`` before the lr). ``grad_clip`` clips the global norm first.
    ``lr`` and the ``kwargs`` named in :data:`VALUE_KWARGS` may be traced float32 scalars
    (the step's ``values``).
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; allowed: {', '.join(OPTIMIZERS)}")
    if not isinstance(weight_decay, int | float) or weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    if grad_clip is not None and not (isinstance(grad_clip, int | float) and grad_clip > 0):
        raise ValueError(f"grad_clip must be > 0 or None, got {grad_clip!r}")
    sched = make_schedule(lr, schedule, steps=steps, warmup_steps=warmup_steps)
    try:
        if name == "sgd":
            tx = optax.sgd(sched, **kwargs)
        elif name == "momentum":
            tx = optax.sgd(sched, momentum=kwargs.pop("momentum", 0.9), **kwargs)
        elif name == "adam":
            tx = optax.adam(sched, **kwargs)
        elif name == "adamw":
            tx = optax.adamw(sched, weight_decay=weight_decay, **kwargs)
        elif name == "lion":
            tx = optax.lion(sched, weight_decay=weight_decay, **kwargs)
        else:
            tx = optax.rmsprop(sched, **kwargs)
    except TypeError as err:
        raise ValueError(f"bad options for optimizer {name!r}: {err}") from err
    parts = []
    if grad_clip is not None:
        parts.append(optax.clip_by_global_norm(grad_clip))
    if weight_decay and name not in ("adamw", "lion"):
        # Decoupled decay scaled by the schedule: added to the gradient-derived direction.
        parts.append(optax.add_decayed_weights(weight_decay))
    parts.append(tx)
    return parts[0] if len(parts) == 1 else optax.chain(*parts)
