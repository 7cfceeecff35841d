"""Data parallelism over the local devices with ``jax.sharding`` and ``jax.shard_map``.

The batch is split along its leading axis over a 1-D mesh (axis ``"data"``). Each device
computes gradients of its shard; the all-reduce (a mean) runs in a selectable dtype, as NCCL
would in a real mixed-precision setup.

ZeRO stages (Rajbhandari et al. 2020) are layouts of the train state over the same axis, given
to XLA's SPMD partitioner as shardings (:class:`ZeroLayout`): stage 0 replicates everything;
stage 1 shards the optimizer state (and the Kahan compensation); stage 2 also the gradients
(a reduce-scatter instead of the all-reduce); stage 3 also the stored params (all-gathered, in
the compute dtype, before the forward pass). A leaf is split along its first axis whose size is
a multiple of the device count; a leaf with no such axis (scalars, a 10-class bias on 8
devices) is replicated whole: no padding, so a device holds ``size / N`` elements of a split
leaf and ``size`` of a replicated one (:func:`shard_axis`). The layout changes where elements
live, not the arithmetic of an elementwise update, so stages 0-3 give bitwise the same params
and losses; what reduces over a sharded tree (the grad-norm metric, and so a global-norm
``grad_clip``) sums per shard and then across devices, in another order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from precisionlab.intercept import _boundary as boundary
from precisionlab.train._distributed import place

__all__ = [
    "AXIS",
    "ZERO_STAGES",
    "ZeroLayout",
    "data_parallel",
    "local_mesh",
    "place_state",
    "replicate",
    "shard_axis",
    "shard_batch",
]

AXIS = "data"
ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)


def local_mesh(num_devices: int | None = None) -> Mesh:
    """A 1-D mesh over the first ``num_devices`` devices (default: all); in a multi-process run
    (:mod:`precisionlab.train._distributed`) these are all processes' devices."""
    devices = jax.devices()
    n = len(devices) if num_devices is None else int(num_devices)
    if not 1 <= n <= len(devices):
        raise ValueError(f"num_devices must be in [1, {len(devices)}], got {num_devices!r}")
    return Mesh(np.asarray(devices[:n]), (AXIS,))


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """Place each batch leaf split along axis 0 over the mesh (axis 0 must divide evenly)."""
    n = mesh.devices.size
    for x in jax.tree_util.tree_leaves(batch):
        if np.shape(x)[0] % n:
            raise ValueError(f"batch size {np.shape(x)[0]} is not divisible by {n} devices")
    return place(batch, NamedSharding(mesh, PartitionSpec(AXIS)))


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Place every leaf of ``tree`` on all devices of the mesh."""
    return place(tree, NamedSharding(mesh, PartitionSpec()))


def shard_axis(shape: tuple[int, ...], n: int) -> int | None:
    """The axis a leaf of ``shape`` is split along over ``n`` devices: the first whose size is a
    positive multiple of ``n``; None (replicate) when there is none or ``n`` is 1."""
    if n <= 1:
        return None
    for axis, size in enumerate(shape):
        if size >= n and size % n == 0:
            return axis
    return None


def _spec(shape: tuple[int, ...], n: int) -> PartitionSpec:
    axis = shard_axis(tuple(shape), n)
    return PartitionSpec() if axis is None else PartitionSpec(*([None] * axis), AXIS)


@dataclasses.dataclass(frozen=True)
class ZeroLayout:
    """Where the train state lives for ZeRO ``stage`` over the 1-D data ``mesh``.

    ``stage`` 0-3 (see the module docstring). Its methods map pytrees of arrays (or
    ShapeDtypeStructs) to shardings: ``device_put`` and ``with_sharding_constraint`` take them.
    """

    mesh: Mesh
    stage: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in ZERO_STAGES:
            raise ValueError(f"zero_stage must be one of 0, 1, 2, 3, got {self.stage!r}")

    @property
    def size(self) -> int:
        return int(self.mesh.devices.size)

    def split(self, tree: Any) -> Any:
        """Shardings splitting every leaf of ``tree`` (replicating leaves that do not divide)."""
        n = self.size
        return jax.tree_util.tree_map(
            lambda x: NamedSharding(self.mesh, _spec(np.shape(x), n)), tree
        )

    def whole(self, tree: Any) -> Any:
        """Shardings replicating every leaf of ``tree``."""
        return jax.tree_util.tree_map(lambda _: NamedSharding(self.mesh, PartitionSpec()), tree)

    def grad_specs(self, params: Any) -> Any:
        """PartitionSpecs (a tree like ``params``) of the gradients a stage >= 2 step
        reduce-scatters; None (an all-reduce of every gradient) below stage 2."""
        if self.stage < 2:
            return None
        return jax.tree_util.tree_map(lambda x: _spec(np.shape(x), self.size), params)

    def state_shardings(self, state: Any) -> Any:
        """Shardings of a :class:`~precisionlab.train._step.TrainState`: params split at stage
        3, optimizer state and Kahan compensation at stage >= 1; the rest replicated."""
        split_params = self.split if self.stage >= 3 else self.whole
        split_opt = self.split if self.stage >= 1 else self.whole
        return state._replace(
            step=self.whole(state.step),
            params=split_params(state.params),
            opt_state=split_opt(state.opt_state),
            loss_scale=self.whole(state.loss_scale),
            storage_state=split_opt(state.storage_state),
            rng=self.whole(state.rng),
            recipe_state=self.whole(state.recipe_state),
            values=self.whole(state.values),
        )


def place_state(state: Any, mesh: Mesh, zero_stage: int = 0) -> Any:
    """Put a TrainState on the mesh in the layout of ``zero_stage`` (0: replicated). Full
    arrays in (a fresh state, a loaded checkpoint: any device count wrote it), shards out."""
    layout = ZeroLayout(mesh, zero_stage)
    # leaf by leaf through distributed.place: also right on a mesh spanning several processes
    return jax.tree_util.tree_map(place, state, layout.state_shardings(state))


def data_parallel(
    grad_fn: Callable,
    mesh: Mesh,
    allreduce_dtype: Any = jnp.float32,
    grad_specs: Any = None,
) -> Callable:
    """Wrap ``grad_fn(params, batch, loss_scale, extra) -> (loss, aux, grads, underflow,
    observed)`` so that it runs per device on its shard of the batch and returns the device-mean
    of every output but ``observed`` (a recipe's amaxes: their max over devices, so the scales
    equal a single device's); the gradient all-reduce runs in ``allreduce_dtype`` (the result is
    cast back to float32). ``extra`` (a recipe's state and key) is replicated.

    ``grad_specs`` (ZeRO stage 2-3, see :meth:`ZeroLayout.grad_specs`): per gradient leaf a
    PartitionSpec; a split leaf is reduce-scattered along its split axis (each device gets its
    slice of the sum), a replicated one all-reduced. On the CPU backend both add the devices'
    partial gradients in device order, so the values are bitwise those of the all-reduce.
    """
    n = mesh.devices.size
    red = np.dtype(allreduce_dtype)
    rep, dat = PartitionSpec(), PartitionSpec(AXIS)

    def reduce(g: jax.Array, spec: PartitionSpec) -> jax.Array:
        g = g.astype(red)
        if AXIS in tuple(spec):
            axis = tuple(spec).index(AXIS)
            g = jax.lax.psum_scatter(g, AXIS, scatter_dimension=axis, tiled=True)
        else:
            g = jax.lax.psum(g, AXIS)
        return g.astype(jnp.float32) / jnp.float32(n)

    def per_device(params: Any, batch: Any, loss_scale: Any, extra: Any) -> tuple[Any, ...]:
        # The replicated inputs enter as varying over the data axis: each device's gradient
        # (and a recipe's observed amaxes) is then its own, reduced below in allreduce_dtype,
        # rather than summed by JAX in the params' dtype (the transpose of an implicit pvary)
        params, loss_scale, extra = boundary.match_varying((params, loss_scale, extra), (AXIS,))
        loss, aux, grads, underflow, observed = grad_fn(params, batch, loss_scale, extra)
        mean = lambda x: jax.lax.pmean(x, AXIS)  # noqa: E731
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        # jaxlib ships no type stub for PyTreeDef's methods
        specs = [rep] * len(leaves) if grad_specs is None else treedef.flatten_up_to(grad_specs)  # type: ignore[attr-defined]
        grads = jax.tree.unflatten(
            treedef, [reduce(g, s) for g, s in zip(leaves, specs, strict=True)]
        )
        observed = jax.tree_util.tree_map(lambda x: jax.lax.pmax(x, AXIS), observed)
        return mean(loss), jax.tree_util.tree_map(mean, aux), grads, mean(underflow), observed

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(rep, dat, rep, rep),
        out_specs=(rep, rep, rep if grad_specs is None else grad_specs, rep, rep),
    )
