"""Step options from the strings a user writes: the edge where spec strings become the typed
objects of :class:`~precisionlab.train._step.StepOptions` (below it nothing parses a string).

A :class:`~precisionlab.train._config.TrainConfig` parses its own fields when it is made; these
two functions are the same edge for code that builds a step without a config.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from precisionlab.mixed._loss_scale import LossScale, parse_loss_scale
from precisionlab.mixed._policy import Policy, get_policy, parse_dtype
from precisionlab.mixed._storage import Storage
from precisionlab.train._step import StepOptions, TrainState, build_step

__all__ = ["make_train_step", "parse_step_options"]


def parse_step_options(
    *,
    policy: Policy | str = "p=f32,c=f32,o=f32",
    loss_scale: LossScale | str = "none",
    storage: Storage | None = None,
    allreduce_dtype: Any = None,
    **kwargs: Any,
) -> StepOptions:
    """A :class:`StepOptions` from specs as a user writes them (a policy string such as
    ``"p=f32,c=bf16,o=f32"``, a loss-scale string such as ``"dynamic"``, a dtype name); the
    other fields as :class:`StepOptions` takes them."""
    red = np.float32 if allreduce_dtype is None else parse_dtype(allreduce_dtype)
    return StepOptions(
        policy=get_policy(policy),
        loss_scale=parse_loss_scale(loss_scale),
        storage=Storage() if storage is None else storage,
        allreduce_dtype=np.dtype(red),
        **kwargs,
    )


def make_train_step(
    loss_fn: Callable,
    params: Any,
    optimizer: optax.GradientTransformation,
    *,
    policy: Policy | str = "p=f32,c=f32,o=f32",
    loss_scale: LossScale | str = "none",
    storage: Storage | None = None,
    microbatches: int = 1,
    seed: int = 0,
    skip_nonfinite: bool | None = None,
    skip: str = "cond",
    data_parallel: bool | int = False,
    allreduce_dtype: Any = None,
    report_leaves: bool = False,
) -> tuple[Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]], TrainState]:
    """``(step_fn, state)`` of :func:`~precisionlab.train._step.build_step` with the options
    given as keywords (policy and loss scale as objects or spec strings, see
    :func:`parse_step_options`); for a data-parallel step use ``build_step``, which also
    returns the mesh."""
    if storage is not None and not isinstance(storage, Storage):
        raise TypeError(f"storage must be a Storage, got {type(storage).__name__}")
    options = parse_step_options(
        policy=policy,
        loss_scale=loss_scale,
        storage=storage,
        microbatches=microbatches,
        seed=seed,
        skip_nonfinite=skip_nonfinite,
        skip=skip,
        data_parallel=data_parallel,
        allreduce_dtype=allreduce_dtype,
        report_leaves=report_leaves,
    )
    fn, state, _ = build_step(loss_fn, params, optimizer, options)
    return fn, state
