"""Models whose pytrees hold more than arrays: differentiate the floating arrays, pass the rest.

An Equinox module keeps its activation (``jax.nn.gelu``, a ``custom_jvp`` function), its
hyperparameters (``Dropout.p``, ``inference``) and its sizes among its pytree leaves; a Flax
NNX module keeps PRNG keys and counters. ``jax.value_and_grad`` refuses such a tree (a
function is not a JAX type; an integer array has no gradient). Equinox's answer,
``eqx.filter_value_and_grad``, differentiates only the floating-point arrays and passes every
other leaf through unchanged, with ``None`` for its gradient; :func:`filter_value_and_grad`
does the same for every precisionlab entry point that differentiates a user's model
(recipes, telemetry, diagnose), so an Equinox model needs no ``eqx.partition`` first and the
gradients have the structure ``eqx.filter(model, eqx.is_inexact_array)`` has (what an optax
state made by Equinox's examples expects). On a pytree of floating arrays it is
``jax.value_and_grad`` exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab.intercept import _boundary as boundary

__all__ = ["filter_jit", "filter_value_and_grad", "is_inexact_array"]


def is_inexact_array(x: Any) -> bool:
    """Whether a pytree leaf is a floating or complex array (a ``jax.Array``, a tracer, a
    numpy array or scalar): the leaves :func:`filter_value_and_grad` differentiates, as
    ``eqx.is_inexact_array`` says. Python numbers, functions, strings, integer and boolean
    arrays and PRNG keys are not."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) and bool(
        jnp.issubdtype(x.dtype, jnp.inexact)
    )


def filter_value_and_grad(
    fn: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable[..., tuple[Any, Any]]:
    """``jax.value_and_grad(fn, argnums, has_aux)`` where the differentiated arguments may
    hold any leaves: only their :func:`is_inexact_array` leaves are differentiated; the others
    (functions, Python numbers, integer arrays, keys) go into ``fn`` unchanged and get ``None``
    as their gradient. The other arguments and keyword arguments are passed as they are.

    Returns ``f(*args, **kwargs) -> (value, grads)`` (``value`` is ``(out, aux)`` with
    ``has_aux``); ``grads`` has each differentiated argument's structure (a tuple of them when
    ``argnums`` is a sequence)."""
    single = isinstance(argnums, int)
    nums: tuple[int, ...] = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    def f(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        for n in nums:
            if not -len(args) <= n < len(args):
                raise ValueError(
                    f"argnums {argnums!r}: argument {n} is out of range for {len(args)} "
                    "positional arguments"
                )
        flat = [jax.tree_util.tree_flatten(args[n]) for n in nums]
        masks = [[is_inexact_array(x) for x in leaves] for leaves, _ in flat]
        diffs = [
            [x if m else None for x, m in zip(leaves, mask, strict=True)]
            for (leaves, _), mask in zip(flat, masks, strict=True)
        ]

        def inner(*parts: Any) -> Any:
            full = list(args)
            for n, part, (leaves, treedef), mask in zip(nums, parts, flat, masks, strict=True):
                merged = [p if m else x for p, x, m in zip(part, leaves, mask, strict=True)]
                full[n] = jax.tree.unflatten(treedef, merged)
            return fn(*full, **kwargs)

        value, grads = jax.value_and_grad(inner, argnums=tuple(range(len(nums))), has_aux=has_aux)(
            *diffs
        )
        out = tuple(
            jax.tree.unflatten(treedef, list(g))
            for g, (_, treedef) in zip(grads, flat, strict=True)
        )
        return value, (out[0] if single else out)

    return f


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def filter_jit(fn: Callable) -> Callable[..., Any]:
    """``jax.jit(fn)`` where the arguments may hold any leaves: the array leaves are traced,
    the others (an Equinox module's functions, Python numbers) are closed over as constants,
    as ``eqx.filter_jit`` does (each call compiles anew: for one-shot programs, such as a
    diagnosis, not for a training loop). Keyword arguments are closed over too."""

    def run(*args: Any, **kwargs: Any) -> Any:
        flat, values = boundary.split_leaves(fn, args, kwargs, _is_array)
        return jax.jit(flat)(*values)

    return run
