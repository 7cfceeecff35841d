"""Identical layers stacked and run under ``lax.scan``, checkpointed every K layers.

Why: the built-in models unroll their layers in Python, and on the CPU backend XLA removes the
optimization barriers ``jax.checkpoint`` puts around unrolled layers, so common-subexpression
elimination merges the recomputation back into the forward pass and nothing is saved. A
checkpointed scan body cannot be merged, so the saving is real on every backend.

:func:`scan_layers` runs ``body(layer, h) -> (h, y)`` over a list of layers whose params have
the same structure, shapes and dtypes, stacked (leaves ``[N, ...]``: the models keep them so
with ``scan_layers``, one leaf per kind of weight whatever the depth, so the step compiles in
a time independent of N), then

- ``remat_every == 0``: one ``lax.scan`` over the N layers (every layer's residuals saved);
- ``remat_every == K``: a scan over ``N // K`` groups of K layers, each group under
  ``jax.checkpoint`` with the named policy (a last group of ``N % K`` layers when K does not
  divide N). The backward pass keeps each group's input (``ceil(N / K)`` carries) and
  recomputes one group at a time (K layers of residuals): memory ``O(N/K) + O(K)``, least
  near ``K = sqrt(N)``, for one extra forward pass.

The arithmetic of each layer is the same as unrolled. Results equal the unrolled path bitwise
where XLA emits the same reductions (tested for the relu MLP); with LayerNorm, attention or a
16-bit compute dtype XLA may sum a reduction in another order inside the loop body, and results
then agree to a few roundings of the compute dtype (tested). Per-layer ``y`` outputs come back
stacked ``[N, ...]``; pass ``None`` when they are not wanted, or the scan keeps them (and their
memory) alive.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "REMAT_POLICIES",
    "check_scan_options",
    "per_layer_options",
    "remat_policy",
    "scan_layers",
    "stack_layers",
    "unstack_layers",
]

#: Names of the ``jax.checkpoint_policies`` a checkpointed group may use: what the forward pass
#: of a group keeps for the backward pass besides the group's input.
REMAT_POLICIES: tuple[str, ...] = (
    "nothing_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "everything_saveable",
)


def remat_policy(name: str) -> Callable[..., bool]:
    """The ``jax.checkpoint_policies`` function called ``name`` (one of :data:`REMAT_POLICIES`)."""
    if name not in REMAT_POLICIES:
        raise ValueError(f"unknown remat_policy {name!r}; allowed: {', '.join(REMAT_POLICIES)}")
    return getattr(jax.checkpoint_policies, name)


def check_scan_options(
    *, scan: bool, remat_every: Any, policy: Any, remat: bool = False, n_layers: int | None = None
) -> None:
    """ValueError unless the options of the scanned path are consistent.

    ``remat_every``: an int >= 0 (0: no checkpointing), > 0 only with ``scan`` and at most
    ``n_layers`` (the stacked layer count, if known); ``policy`` a name in
    :data:`REMAT_POLICIES`; ``remat`` (a checkpoint around each unrolled block) excludes ``scan``.
    """
    if isinstance(remat_every, bool) or not isinstance(remat_every, int) or remat_every < 0:
        raise ValueError(f"remat_every must be an int >= 0 (0: off), got {remat_every!r}")
    remat_policy(policy)
    if remat_every and not scan:
        raise ValueError(
            f"remat_every={remat_every} needs scan_layers=True: checkpointed unrolled layers "
            "are merged back by XLA (no memory saved)"
        )
    if scan and remat:
        raise ValueError(
            "remat (a checkpoint around each unrolled block) and scan_layers are exclusive; "
            "with scan_layers use remat_every=1"
        )
    if n_layers is not None and remat_every > n_layers:
        raise ValueError(
            f"remat_every={remat_every} exceeds the {n_layers} stacked layers; "
            f"allowed: 0..{n_layers}"
        )


def per_layer_options(model: Any) -> list[str]:
    """Names of a model dataclass's options that hold a collection (a per-layer list, set,
    mapping): set, they make layers differ, so the layers cannot be stacked."""
    return [
        f.name
        for f in dataclasses.fields(model)
        if isinstance(getattr(model, f.name), list | tuple | dict | set | frozenset)
        and len(getattr(model, f.name))
    ]


def stack_layers(layers: Sequence[Any], what: str = "layer") -> Any:
    """Stack the params of ``layers`` leafwise (leaves ``[N, ...]``; numpy arrays and
    ``jax.ShapeDtypeStruct`` leaves stay on the host: no computation).

    Raises:
      ValueError: naming the first layer whose structure, shape or dtype differs from layer 0.
    """
    if not layers:
        raise ValueError(f"no {what}s to stack")
    ref = jax.tree_util.tree_structure(layers[0])
    ref_leaves = jax.tree_util.tree_leaves(layers[0])
    for i, layer in enumerate(layers[1:], 1):
        struct = jax.tree_util.tree_structure(layer)
        if struct != ref:  # type: ignore[operator]  # jaxlib's PyTreeDef stub has no __ne__
            raise ValueError(
                f"{what} {i} cannot be stacked with {what} 0: its params differ in structure "
                f"({struct} vs {ref}); scan_layers needs identical layers"
            )
        for a, b in zip(jax.tree_util.tree_leaves(layer), ref_leaves, strict=True):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(
                    f"{what} {i} cannot be stacked with {what} 0: a param is {a.dtype}"
                    f"{list(a.shape)}, not {b.dtype}{list(b.shape)}; scan_layers needs "
                    "identical layers"
                )
    return jax.tree_util.tree_map(_stack, *layers)


def _stack(*xs: Any) -> Any:
    if isinstance(xs[0], jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype)
    if all(isinstance(x, np.ndarray) for x in xs):
        return np.stack(xs)
    return jnp.stack(xs)


def unstack_layers(stacked: Any) -> list[Any]:
    """The inverse of :func:`stack_layers`: a list of the N layers of a stacked pytree."""
    leaves = jax.tree_util.tree_leaves(stacked)
    n = leaves[0].shape[0] if leaves else 0
    return [jax.tree_util.tree_map(lambda a, i=i: a[i], stacked) for i in range(n)]


def scan_layers(
    body: Callable[[Any, jax.Array], tuple[jax.Array, Any]],
    layers: Sequence[Any] | Any,
    h: jax.Array,
    *,
    remat_every: int = 0,
    policy: str = "nothing_saveable",
    what: str = "layer",
    scope: str | None = None,
    first: int = 0,
) -> tuple[jax.Array, Any]:
    """``h`` through ``body(layer, h) -> (h, y)`` for each layer in order, under ``lax.scan``;
    returns ``(h, ys)`` with ``ys`` stacked ``[N, ...]`` (see module docstring).

    ``layers``: stacked params (leaves ``[N, ...]``) or a list of per-layer params (stacked
    here, a copy inside the step). ``remat_every``: K >= 1 checkpoints groups of K layers
    (0: off); ``policy`` names what a group saves (:data:`REMAT_POLICIES`). ``scope``: the
    body runs under ``jax.named_scope(f"{scope}{{{n}+i}}")`` (``"layer{1+i}"``), the template
    :meth:`precisionlab.intercept.Site.layer` turns into the name of the layer an iteration
    runs (``"layer3"``: ``scope`` and ``first`` plus the layer's position in the stack).
    """
    stacked = stack_layers(layers, what) if isinstance(layers, list | tuple) else layers
    n = jax.tree_util.tree_leaves(stacked)[0].shape[0]
    check_scan_options(scan=True, remat_every=remat_every, policy=policy, n_layers=n)

    def runner(start: int) -> Callable[[jax.Array, Any], tuple[jax.Array, Any]]:
        def step(carry: jax.Array, layer: Any) -> tuple[jax.Array, Any]:
            if scope is None:
                return body(layer, carry)
            with jax.named_scope(f"{scope}{{{start}+i}}"):  # flat iteration i: layer start + i
                return body(layer, carry)

        return lambda carry, group: jax.lax.scan(step, carry, group)

    run = runner(first)
    if not remat_every:
        return run(h, stacked)
    k = remat_every
    groups, rest = divmod(n, k)
    run_ck = jax.checkpoint(run, policy=remat_policy(policy))

    def grouped(a: jax.Array) -> jax.Array:
        return a[: groups * k].reshape(groups, k, *a.shape[1:])

    h, ys = jax.lax.scan(run_ck, h, jax.tree_util.tree_map(grouped, stacked))
    ys = jax.tree_util.tree_map(lambda y: y.reshape(groups * k, *y.shape[2:]), ys)
    if rest:
        run_rest = jax.checkpoint(runner(first + groups * k), policy=remat_policy(policy))
        h, ys_rest = run_rest(h, jax.tree_util.tree_map(lambda a: a[groups * k :], stacked))
        ys = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b]), ys, ys_rest)
    return h, ys
