"""Memory of the built-in models of :mod:`precisionlab.train`, estimated and measured.

- :func:`param_count`: the parameter count of a built-in MLP, transformer or conv, from its sizes
  (not from its params pytree), so it can be checked against ``Model.param_count``.
- :func:`transformer_spec`: the :class:`ModelSpec` of a built-in transformer, for
  :func:`~precisionlab.memory._estimate.estimate`.
- :func:`activation_bytes`: what the model keeps for its backward pass, from its sizes.
- :func:`measure_train_table`: estimate vs XLA for the train step of a ``[train]`` table, built
  exactly as ``precisionlab.train`` builds it (``make_train_step``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab.memory._estimate import (
    OPTIMIZERS,
    ModelSpec,
    layer_activation_bytes,
    tree_bytes,
)
from precisionlab.memory._measure import Measured, measure
from precisionlab.memory._recipe import builtin_gemms, recipe_memory
from precisionlab.mixed import Policy, get_policy
from precisionlab.train import Model, StepOptions, TrainConfig, TrainState, build, build_step
from precisionlab.train._recipe import TrainRecipe

__all__ = [
    "activation_bytes",
    "example_batch",
    "measure_train_table",
    "param_count",
    "transformer_spec",
]


def _conv_blocks(model: Any) -> tuple[list[tuple[int, int, int, bool]], int]:
    """Per conv block ``(side, c_in, c_out, pool)`` and the flattened size fed to the output
    layer, from the sizes alone (as :mod:`precisionlab.train._models.conv_ops` lays the model
    out: 3x3 SAME convolutions, a 2x2 max pool while the side is even and > 1)."""
    side = math.isqrt(model.in_dim)
    c_in, blocks = 1, []
    for i in range(model.depth):
        c_out = model.width * 2**i
        pool = side % 2 == 0 and side > 1
        blocks.append((side, c_in, c_out, pool))
        side, c_in = (side // 2 if pool else side), c_out
    return blocks, side * side * c_in


def param_count(model: Any) -> int:
    """Parameters of a built-in ``mlp``, ``transformer`` or ``conv``, counted from its sizes."""
    if model.name == "conv":
        blocks, flat = _conv_blocks(model)
        convs = sum(9 * ci * co + co for _, ci, co, _ in blocks)
        return convs + flat * model.num_classes + model.num_classes
    if model.name == "mlp":
        ln = 2 * model.width if model.use_layernorm else 0
        hidden = model.in_dim * model.width + model.width + ln
        hidden += (model.depth - 1) * (model.width * model.width + model.width + ln)
        return hidden + model.width * model.num_classes + model.num_classes
    if model.name == "transformer":
        d, f, v = model.d_model, model.d_model * model.mlp_ratio, model.vocab_size
        block = 3 * d * d + d * d + d * f + f + f * d + d + (4 * d if model.use_layernorm else 0)
        final = 2 * d if model.use_layernorm else 0
        return v * d + model.seq_len * d + model.depth * block + d * v + final
    raise ValueError(f"unknown built-in model {model.name!r}; allowed: mlp, transformer, conv")


def transformer_spec(model: Any) -> ModelSpec:
    """The :class:`ModelSpec` of a built-in transformer."""
    if model.name != "transformer":
        raise ValueError(f"transformer_spec needs a transformer, got {model.name!r}")
    return ModelSpec(
        name=f"transformer(d={model.d_model}, depth={model.depth})",
        n_params=param_count(model),
        n_layers=model.depth,
        d_model=model.d_model,
        n_heads=model.heads,
        d_head=model.d_model // model.heads,
        vocab=model.vocab_size,
        seq_len=model.seq_len,
        d_ff=model.d_model * model.mlp_ratio,
    )


def activation_bytes(model: Any, batch: int, policy: Policy | str) -> int:
    """Bytes the model keeps for its backward pass for ``batch`` examples.

    Transformer: ``depth`` times the transformer-block count of :func:`layer_activation_bytes`
    (no dropout), plus per layer two more heads x seq x seq tensors, because the built-in
    attention (no fused kernel) keeps the scaled scores (compute dtype) and the softmax output
    (float32 when the policy keeps softmax in float32) besides the masked probabilities; plus the
    logits in the compute dtype and their float32 softmax. MLP: per hidden layer the dense
    output, the activation and its derivative, plus float32 logits. Conv: per block the same
    three for the convolution's output, plus the pooled output, plus float32 logits.
    """
    policy = get_policy(policy)
    e = np.dtype(policy.compute_dtype).itemsize
    if model.name == "transformer":
        spec = transformer_spec(model)
        _, block = layer_activation_bytes(
            spec, batch=batch, seq=model.seq_len, dtype=policy.compute_dtype
        )
        scores = model.heads * model.seq_len**2 * batch
        softmax = np.dtype(policy.op_dtype("softmax")).itemsize
        logits = batch * model.seq_len * model.vocab_size * (e + 4)
        return model.depth * (block + scores * (e + softmax)) + logits
    if model.name == "mlp":
        return model.depth * 3 * batch * model.width * e + batch * model.num_classes * 4
    if model.name == "conv":
        blocks, _ = _conv_blocks(model)
        kept = 0
        for side, _, c_out, pool in blocks:
            # the convolution's output, the activation and its derivative (as the MLP's dense
            # layers), and with a pool its output
            kept += 3 * side * side * c_out + (side * side * c_out // 4 if pool else 0)
        return batch * kept * e + batch * model.num_classes * 4
    raise ValueError(f"unknown built-in model {model.name!r}; allowed: mlp, transformer, conv")


def example_batch(model: Any, batch: int) -> dict[str, jax.Array]:
    """A batch of zeros (memory does not depend on the values)."""
    shapes = model.example_batch(batch)
    return {k: jnp.zeros(s.shape, s.dtype) for k, s in shapes.items()}


def scalar_bytes(tree: Any) -> int:
    """Bytes of the bookkeeping leaves (0-d counters and scales, the 2-word PRNG key)."""
    return sum(
        tree_bytes(leaf) for leaf in jax.tree_util.tree_leaves(tree) if np.ndim(leaf) == 0
    ) + sum(
        tree_bytes(leaf)
        for leaf in jax.tree_util.tree_leaves(tree)
        if np.ndim(leaf) == 1 and leaf.shape[0] == 2 and leaf.dtype == np.uint32
    )


def table_step_options(cfg: Any, setup: Any, *, dp: int = 0, zero_stage: int = 0) -> Any:
    """The ``StepOptions`` the memory measurements compile for a ``TrainConfig`` ``cfg`` and
    its ``precisionlab.train.build(cfg)`` ``setup``: the setup's policy, loss scale, storage and
    recipe, ``cfg``'s micro-batches and seed, and with ``dp`` devices data parallel with ZeRO
    ``zero_stage`` and the setup's all-reduce dtype (no telemetry, no float32 layers)."""
    opts = setup.options
    parallel: dict[str, Any] = {}
    if dp:
        parallel = dict(
            data_parallel=dp, zero_stage=zero_stage, allreduce_dtype=opts.allreduce_dtype
        )
    return StepOptions(
        policy=setup.policy,
        loss_scale=opts.loss_scale,
        storage=opts.storage,
        microbatches=cfg.microbatches,
        seed=cfg.seed,
        recipe=opts.recipe,
        **parallel,
    )


def measure_train_table(table: dict[str, Any], where: str = "train") -> dict[str, Any]:
    """Estimate vs XLA for the train step of a resolved ``[train]`` table.

    The step is built as :func:`precisionlab.train.train` builds it (``build_step`` with
    the table's policy, loss scale, storage dtypes and micro-batches) and compiled with its state
    donated. Estimated arguments: params (counted from the model's sizes) in their storage dtype,
    the optimizer's moments in the optimizer-state dtype, Kahan compensation if any, bookkeeping
    scalars (step, loss scale, counters, PRNG key) and the batch. Outputs: the same state, the
    metrics and XLA's tuple index table. Temporaries: float32 gradients, the compute copy of the
    params, the activations of one micro-batch, with micro-batches an accumulator, and float32
    working copies of params and optimizer moments stored below float32, and the float32
    magnitudes of the gradients the step's meters read.
    """
    cfg = TrainConfig.from_dict(dict(table), where)
    setup = build(cfg)
    model, policy, storage = setup.model, setup.policy, setup.options.storage
    options = table_step_options(cfg, setup)
    batch = example_batch(model, cfg.batch_size)
    step_fn, state, _ = build_step(
        setup.loss_fn, setup.params, setup.optimizer, options, example_batch=batch
    )
    got = measure(step_fn, state, batch, donate_argnums=(0,), run=False)

    n = param_count(model)
    p_bytes = n * np.dtype(storage.param_dtype(policy.param_dtype)).itemsize
    moments = OPTIMIZERS.get(cfg.optimizer, (0, 0))[0]
    opt_bytes = moments * n * np.dtype(storage.opt_state).itemsize
    kahan = p_bytes if cfg.update_rounding == "kahan" else 0
    scalars = scalar_bytes(state)
    batch_bytes = tree_bytes(batch)
    recipe_info = None
    if options.recipe is not None:
        recipe_info = _recipe_part(table, where, options.recipe, model, cfg, state, got)
        scalars += recipe_info["state_bytes"]
    arguments = p_bytes + opt_bytes + kahan + scalars + batch_bytes
    metrics = jax.eval_shape(step_fn, state, batch)[1]
    n_out = len(jax.tree_util.tree_leaves(state)) + len(jax.tree_util.tree_leaves(metrics))
    outputs = p_bytes + opt_bytes + kahan + scalars + tree_bytes(metrics) + 8 * n_out
    micro = cfg.batch_size // cfg.microbatches
    mixed = policy.compute_dtype != policy.param_dtype
    # State stored below float32 is worked on in float32: the optimizer's moments are
    # decompressed for the update, and the update is applied to float32 params.
    opt_work = moments * n * 4 if np.dtype(storage.opt_state).itemsize < 4 else 0
    param_work = 4 * n if p_bytes < 4 * n else 0
    temporaries = (
        4 * n
        + (n * np.dtype(policy.compute_dtype).itemsize if mixed else 0)
        + activation_bytes(model, micro, policy)
        + (4 * n if cfg.microbatches > 1 else 0)
        + opt_work
        + param_work
        # the step's two gradient meters (zero/subnormal and inf/NaN fractions) are two
        # reductions over the gradients' float32 magnitudes: XLA keeps one float32 copy
        # (measured: exactly 4 bytes per parameter more since the meters were split)
        + 4 * n
    )
    rows = []
    for name, est, meas in (
        ("arguments", arguments, got.arguments),
        ("outputs", outputs, got.outputs),
        ("temporaries", temporaries, got.temporaries),
    ):
        rows.append({"name": name, "estimated": est, "measured": meas, "ratio": meas / est})
    return {
        "description": (
            f"{cfg.model} ({n:,} params), batch {cfg.batch_size}, {policy}, {cfg.optimizer}, "
            f"loss scale {cfg.loss_scale}, {cfg.microbatches} micro-batch(es)"
            + (f", recipe {recipe_info['hardware']['recipe']}" if recipe_info else "")
        ),
        "rows": rows,
        "flops": got.flops or 0.0,
        "backend": got.backend,
        "n_params": n,
        "recipe": recipe_info,
    }


def _recipe_part(
    table: dict[str, Any],
    where: str,
    train_recipe: TrainRecipe,
    model: Model,
    cfg: TrainConfig,
    state: TrainState,
    got: Measured,
) -> dict[str, Any]:
    """A recipe step's extra memory: its state in the arguments (delayed scaling: float32
    (L + 2) x 3 per matmul site, counted from the model's matmuls; with include/exclude, from
    the sites the state holds), the copies hardware would keep (:mod:`._recipe`), and XLA's
    temporaries of the same step without the recipe, measured for the difference."""
    recipe = train_recipe.recipe
    gemms = builtin_gemms(model, cfg.batch_size // cfg.microbatches)
    hardware = recipe_memory(recipe, gemms).to_dict()  # first: it refuses what it cannot model
    if train_recipe.include is not None or train_recipe.exclude:
        n_sites = len(state.recipe_state or {})
    else:
        n_sites = len(gemms)
    state_bytes = 0
    if train_recipe.stateful:
        history = getattr(recipe, "amax_history_len", None)
        assert history is not None  # delayed scaling: recipe_memory refused the FP4 recipes
        state_bytes = n_sites * 4 * 3 * (history + 2)
    plain = {k: v for k, v in table.items() if k != "recipe"}
    without = measure_train_table(plain, where)
    return {
        "state_bytes": state_bytes,
        "hardware": hardware,
        "temporaries": got.temporaries,
        "temporaries_without": next(
            r["measured"] for r in without["rows"] if r["name"] == "temporaries"
        ),
    }
