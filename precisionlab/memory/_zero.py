"""Per-device memory of a ZeRO train step: estimated from shapes, measured from XLA.

:func:`zero_state_bytes` is the estimator: the bytes one device holds of the params, the
gradients and the optimizer state of a built-in model trained with ZeRO stage S over N
data-parallel devices, counted from the leaves' shapes. precisionlab splits a leaf along its
first axis whose size is a multiple of N and replicates a leaf with no such axis (no padding):
a split leaf costs ``size / N`` elements per device, a replicated one ``size``. (The
transformer-preset estimate :func:`~precisionlab.memory._estimate.estimate`, which knows no
leaves, counts ``ceil(n_params / N)``: a flat, padded split; the two differ by the replicated
leaves.)

:func:`measure_zero_table` builds the train step of a ``[train]`` table exactly as
``precisionlab.train`` does with ``data_parallel = N`` and ``zero_stage = S``, compiles it
for N devices with the state placed in the stage's layout and donated, and reads XLA's
``memory_analysis()`` (per device: the partitioned program of one device) and the per-device
argument shapes the compiled program takes (``input_shardings``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab.memory._builtin import (
    activation_bytes,
    example_batch,
    param_count,
    scalar_bytes,
    table_step_options,
)
from precisionlab.memory._estimate import OPTIMIZERS, POINTER_BYTES, tree_bytes
from precisionlab.train import TrainConfig, build, build_step
from precisionlab.train._parallel import place_state, shard_batch

__all__ = ["ZERO_PARTS", "leaf_elements_per_device", "measure_zero_table", "zero_state_bytes"]

#: The parts :func:`zero_state_bytes` returns.
ZERO_PARTS: tuple[str, ...] = ("params", "gradients", "optimizer_state", "compensation")


def leaf_elements_per_device(shape: tuple[int, ...], n: int, split: bool) -> int:
    """Elements of a leaf of ``shape`` one of ``n`` devices holds: ``size / n`` when ``split``
    and some axis is a positive multiple of ``n``, else the whole ``size``."""
    size = math.prod(shape)
    if split and n > 1 and any(d >= n and d % n == 0 for d in shape):
        return size // n
    return size


def zero_state_bytes(
    param_shapes: Any,
    *,
    stage: int,
    dp: int,
    param_dtype: Any,
    opt_state_dtype: Any,
    optimizer: str,
    kahan: bool = False,
) -> dict[str, int]:
    """Bytes per device of the model states under ZeRO ``stage`` over ``dp`` devices.

    Args:
      param_shapes: a pytree of arrays or ShapeDtypeStructs (only the shapes are read).
      param_dtype / opt_state_dtype: storage dtypes of params and optimizer moments
        (fp8 moments: the fp8 values; their float32 scales are scalars, not counted here).
      optimizer: a name in :data:`~precisionlab.memory._estimate.OPTIMIZERS` (moments per
        param; other names: none).
      kahan: Kahan compensation (one param-dtype copy, sharded with the optimizer state).

    Returns ``{"params", "gradients" (float32, as the step hands them to the optimizer),
    "optimizer_state", "compensation"}``. Stage 1 splits the optimizer state and the
    compensation, 2 also the gradients, 3 also the params.
    """
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be one of 0, 1, 2, 3, got {stage!r}")
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp must be an int >= 1, got {dp!r}")
    shapes = [tuple(np.shape(x)) for x in jax.tree_util.tree_leaves(param_shapes)]

    def elements(split: bool) -> int:
        return sum(leaf_elements_per_device(s, dp, split) for s in shapes)

    moments = OPTIMIZERS.get(optimizer, (0, 0))[0]
    p_item, o_item = np.dtype(param_dtype).itemsize, np.dtype(opt_state_dtype).itemsize
    return {
        "params": elements(stage >= 3) * p_item,
        "gradients": elements(stage >= 2) * 4,
        "optimizer_state": moments * elements(stage >= 1) * o_item,
        "compensation": elements(stage >= 1) * p_item if kahan else 0,
    }


def _per_device_bytes(tree: Any, shardings: Any) -> int:
    """Bytes of the per-device buffers of the non-scalar leaves of ``tree`` laid out as
    ``shardings`` (scalars are bookkeeping, counted apart)."""
    total = 0
    leaves, specs = jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(shardings)
    for leaf, sh in zip(leaves, specs, strict=True):
        if np.ndim(leaf) > 0:
            shape = sh.shard_shape(tuple(leaf.shape))
            total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def measure_zero_table(
    table: dict[str, Any], where: str = "train", *, zero_stage: int, dp: int
) -> dict[str, Any]:
    """Estimate vs XLA, per device, of the train step of a ``[train]`` table with ZeRO
    ``zero_stage`` over ``dp`` local devices (the process must have them: on CPU,
    ``XLA_FLAGS=--xla_force_host_platform_device_count=N``).

    Estimated arguments: params, optimizer state and compensation per device
    (:func:`zero_state_bytes`), the replicated bookkeeping scalars (step, loss scale, optimizer
    counters, fp8 scales, PRNG key), a replicated recipe state, and the device's slice of the
    batch. Outputs: the same state, the (replicated) metrics and XLA's tuple index table.
    Measured: ``memory_analysis()`` of the compiled step, and the params and optimizer-state
    part of its arguments read from the per-device shapes the compiled program takes.
    Temporaries (not exact): float32 gradients, the compute copy (all-gathered whole at stage
    3), the activations of the device's micro-batch; measured beside it for information.
    """
    if len(jax.local_devices()) < dp:
        raise ValueError(
            f"dp={dp} needs {dp} devices, this process has {len(jax.local_devices())} "
            f"(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={dp})"
        )
    cfg = TrainConfig.from_dict(dict(table), where)
    if cfg.batch_size % (dp * cfg.microbatches):
        raise ValueError(
            f"{where}: batch_size {cfg.batch_size} is not divisible by dp={dp} x "
            f"microbatches={cfg.microbatches}"
        )
    setup = build(cfg)
    model, policy, storage = setup.model, setup.policy, setup.options.storage
    options = table_step_options(cfg, setup, dp=dp, zero_stage=zero_stage)
    batch = example_batch(model, cfg.batch_size)
    step_fn, state, mesh = build_step(setup.loss_fn, setup.params, setup.optimizer, options, batch)
    state = jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), state)
    state = place_state(state, mesh, zero_stage)
    batch = shard_batch(batch, mesh)
    compiled = jax.jit(step_fn, donate_argnums=0).lower(state, batch).compile()
    stats = compiled.memory_analysis()
    if stats is None:  # a backend that reports no buffer assignment
        raise ValueError(f"XLA gives no memory analysis on {jax.default_backend()}")
    in_state = compiled.input_shardings[0][0]

    param_dtype = storage.param_dtype(policy.param_dtype)
    est = zero_state_bytes(
        setup.params,
        stage=zero_stage,
        dp=dp,
        param_dtype=param_dtype,
        opt_state_dtype=storage.opt_state,
        optimizer=cfg.optimizer,
        kahan=cfg.update_rounding == "kahan",
    )
    scalars = scalar_bytes(state._replace(recipe_state=None))
    recipe = tree_bytes(state.recipe_state) if state.recipe_state else 0
    batch_dev = tree_bytes(batch) // dp
    metrics = jax.eval_shape(step_fn, state, batch)[1]
    n_out = len(jax.tree_util.tree_leaves(state)) + len(jax.tree_util.tree_leaves(metrics))
    held = est["params"] + est["optimizer_state"] + est["compensation"] + scalars + recipe
    arguments = held + batch_dev
    outputs = held + tree_bytes(metrics) + POINTER_BYTES * n_out

    measured_params = _per_device_bytes(state.params, in_state.params)
    measured_opt = _per_device_bytes(state.opt_state, in_state.opt_state)

    n = param_count(model)
    micro = cfg.batch_size // dp // cfg.microbatches
    mixed = policy.compute_dtype != policy.param_dtype
    temporaries = (
        4 * n
        + (n * np.dtype(policy.compute_dtype).itemsize if mixed else 0)
        + activation_bytes(model, micro, policy)
        + (4 * n if cfg.microbatches > 1 else 0)
    )
    rows = []
    for name, e, m in (
        ("params", est["params"], measured_params),
        ("optimizer state", est["optimizer_state"], measured_opt),
        ("gradients", est["gradients"], None),
        ("arguments", arguments, int(stats.argument_size_in_bytes)),
        ("outputs", outputs, int(stats.output_size_in_bytes)),
        ("temporaries", temporaries, int(stats.temp_size_in_bytes)),
    ):
        rows.append(
            {"name": name, "estimated": e, "measured": m, "ratio": None if m is None else m / e}
        )
    return {
        "description": (
            f"{cfg.model} ({n:,} params), batch {cfg.batch_size}, {policy}, {cfg.optimizer}, "
            f"ZeRO stage {zero_stage} over {dp} devices, per device"
        ),
        "zero_stage": zero_stage,
        "dp": dp,
        "rows": rows,
        "backend": jax.default_backend(),
        "n_params": n,
    }
