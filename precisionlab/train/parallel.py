"""Data parallelism over the local devices with ``jax.sharding`` and ``jax.shard_map``.

The batch is split along its leading axis over a 1-D mesh (axis ``"data"``); params, optimizer
state and loss scale are replicated. Each device computes gradients of its shard; the all-reduce
(a mean) runs in a selectable dtype, as NCCL would in a real mixed-precision setup.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from precisionlab.train.distributed import place

__all__ = ["AXIS", "data_parallel", "local_mesh", "replicate", "shard_batch"]

AXIS = "data"


def local_mesh(num_devices: int | None = None) -> Mesh:
    """A 1-D mesh over the first ``num_devices`` devices (default: all); in a multi-process run
    (:mod:`precisionlab.train.distributed`) these are all processes' devices."""
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


def data_parallel(grad_fn: Callable, mesh: Mesh, allreduce_dtype: Any = jnp.float32) -> Callable:
    """Wrap ``grad_fn(params, batch, loss_scale, extra) -> (loss, aux, grads, underflow,
    observed)`` so that it runs per device on its shard of the batch and returns the device-mean
    of every output but ``observed`` (a recipe's amaxes: their max over devices, so the scales
    equal a single device's); the gradient all-reduce runs in ``allreduce_dtype`` (the result is
    cast back to float32). ``extra`` (a recipe's state and key) is replicated."""
    n = mesh.devices.size
    red = np.dtype(allreduce_dtype)

    def per_device(params, batch, loss_scale, extra):
        loss, aux, grads, underflow, observed = grad_fn(params, batch, loss_scale, extra)
        mean = lambda x: jax.lax.pmean(x, AXIS)  # noqa: E731
        grads = jax.tree_util.tree_map(
            lambda g: jax.lax.psum(g.astype(red), AXIS).astype(jnp.float32) / jnp.float32(n),
            grads,
        )
        observed = jax.tree_util.tree_map(lambda x: jax.lax.pmax(x, AXIS), observed)
        return mean(loss), jax.tree_util.tree_map(mean, aux), grads, mean(underflow), observed

    rep, dat = PartitionSpec(), PartitionSpec(AXIS)
    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(rep, dat, rep, rep),
        out_specs=(rep, rep, rep, rep, rep),
        check_vma=False,
    )
