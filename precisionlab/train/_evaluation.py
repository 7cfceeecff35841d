"""Evaluation of params on a fixed list of batches (one jitted scan over them)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab.mixed._policy import Policy, cast_floating, get_policy
from precisionlab.train import _programs as programs
from precisionlab.train._deterministic import fixed_order
from precisionlab.train._step import (
    normalize_loss_fn,
)

__all__ = ["evaluate", "make_eval_fn"]


def make_eval_fn(
    loss_fn: Callable, policy: Policy, batches: list[Any], *, program_key: Hashable = None,
    deterministic: bool = False,
) -> Callable[[Any], dict[str, float]]:  # fmt: skip
    """``eval_fn(params) -> {"eval_loss", "eval_metric"}``: mean over ``batches`` of the loss and
    of aux ``metric`` (nan if absent), with params cast to the compute dtype. Jitted; with a
    ``program_key`` (see :mod:`precisionlab.train._programs`), one jitted function serves every
    call under that key (the batches are its argument). ``eval_fn.lower(params)`` lowers it
    (``.compile()`` then compiles it ahead of the first call). ``deterministic``: its matmuls
    and sums in a fixed order (``precisionlab.train._deterministic.fixed_order``)."""
    stacked = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *batches)
    if program_key is None:
        run = _make_run(loss_fn, policy, deterministic)
    else:
        key = ("eval", program_key, deterministic)
        run = programs.get(key, lambda: _make_run(loss_fn, policy, deterministic))

    def eval_fn(params: Any) -> dict[str, float]:
        loss, metric = run(params, stacked)
        return {"eval_loss": float(loss), "eval_metric": float(metric)}

    # ``eval_fn.lower(params).compile()`` compiles it ahead of the first call
    eval_fn.lower = lambda params: run.lower(params, stacked)  # type: ignore[attr-defined]
    return eval_fn


def _make_run(loss_fn: Callable, policy: Policy, deterministic: bool = False) -> Callable:
    """``run(params, stacked_batches) -> (mean loss, mean metric)``, jitted."""
    f = normalize_loss_fn(loss_fn)

    def run(params: Any, stacked: Any) -> tuple[jax.Array, jax.Array]:
        pc = cast_floating(params, policy.compute_dtype)

        def one(carry: None, b: Any) -> tuple[None, tuple[jax.Array, jax.Array]]:
            loss, aux = f(pc, b)
            metric = aux.get("metric", jnp.nan) if isinstance(aux, dict) else jnp.nan
            return carry, (loss.astype(jnp.float32), jnp.asarray(metric, jnp.float32))

        _, (losses, metrics) = jax.lax.scan(one, None, stacked)
        return jnp.mean(losses), jnp.mean(metrics)

    if deterministic:
        return jax.jit(fixed_order(run))
    return jax.jit(run)


def evaluate(
    model_or_loss_fn: Any,
    params: Any,
    batches: list[Any],
    *,
    policy: Policy | str = "p=f32,c=f32,o=f32",
) -> dict[str, float]:
    """Evaluate a built-in Model (or a ``loss_fn``) on ``batches``: eval_loss, eval_metric."""
    pol = get_policy(policy)
    loss_fn = (
        model_or_loss_fn.loss_fn(pol) if hasattr(model_or_loss_fn, "loss_fn") else model_or_loss_fn
    )
    return make_eval_fn(loss_fn, pol, batches)(params)
