"""Where the memory of a training step goes: weights, master weights, gradients, optimizer state,
activations and temporaries, estimated from a model description and a training setup.

Two entry points:

- :func:`estimate` takes a transformer description (:class:`ModelSpec`, e.g. a GPT-3 preset) and a
  :class:`TrainSetup` and returns a :class:`Breakdown` in bytes per device. This is the textbook
  accounting: mixed-precision Adam costs 2 (fp16 weights) + 2 (fp16 gradients) + 4 + 4 + 4
  (fp32 master copy, first and second moment) = 16 bytes per parameter; the activations at a
  layer boundary are batch x seq x d_model x bytes per layer.
- :func:`estimate_step` takes a params pytree, a batch and the bytes of activations the model saves
  for the backward pass, and predicts what XLA reports for a jitted train step
  (``compiled.memory_analysis()``): argument, output and temporary sizes.

All sizes are bytes (ints). Decimal GB = 1e9 bytes, GiB = 2**30 bytes (see ``units``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from precisionlab.memory._rows import byte_dict, byte_rows, byte_sum
from precisionlab.mixed import Policy, get_policy, parse_dtype

__all__ = [
    "OPTIMIZERS",
    "Breakdown",
    "ModelSpec",
    "StepEstimate",
    "TrainSetup",
    "best_checkpoint_interval",
    "estimate",
    "estimate_step",
    "layer_activation_bytes",
    "tree_bytes",
]

#: Optimizer -> (moments stored per parameter, int32 step counters). optax's adam/adamw keep mu and
#: nu and a count; lion keeps mu and a count; sgd with momentum keeps a trace; plain sgd nothing.
OPTIMIZERS: dict[str, tuple[int, int]] = {
    "sgd": (0, 0),
    "momentum": (1, 0),
    "lion": (1, 1),
    "adam": (2, 1),
    "adamw": (2, 1),
}
# XLA returns a tuple of buffers; on 64-bit hosts its index table costs one pointer per leaf and
# is counted in ``output_size_in_bytes``.
POINTER_BYTES = 8


# Sizes are bounded before any arithmetic or search depends on them (a 400-digit sequence
# length would overflow the float columns of the table; a huge batch, the divisor search).
MAX_COUNT = 2**40
MAX_LAYERS = 2**16


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _positive_int(value: Any, name: str, limit: int = MAX_COUNT) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {_short_repr(value)}")
    if value > limit:
        raise ValueError(
            f"{name} must be at most {limit:,} (2^{limit.bit_length() - 1}), got a "
            f"{len(str(int(value)))}-digit number"
        )
    return int(value)


def _optimizer(name: str) -> tuple[int, int]:
    if not isinstance(name, str) or name.lower() not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; allowed: {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name.lower()]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer described by its sizes.

    Attributes:
      name: display name.
      n_params: parameter count (as published for presets).
      n_layers: transformer blocks.
      d_model: width of the residual stream.
      n_heads, d_head: attention heads and their width.
      vocab: vocabulary size (logits are batch x seq x vocab).
      seq_len: default sequence length (the context window).
      d_ff: MLP hidden width; None means 4 x d_model.
      batch_tokens, learning_rate: the published training setup, for information.
    """

    name: str
    n_params: int
    n_layers: int
    d_model: int
    n_heads: int
    d_head: int
    vocab: int = 50257
    seq_len: int = 2048
    d_ff: int | None = None
    batch_tokens: int | None = None
    learning_rate: float | None = None

    def __post_init__(self) -> None:
        for field in ("n_params", "n_layers", "d_model", "n_heads", "d_head", "vocab", "seq_len"):
            limit = {"n_params": 2**50, "n_layers": MAX_LAYERS}.get(field, MAX_COUNT)
            _positive_int(getattr(self, field), f"{self.name}: {field}", limit)
        if self.d_ff is not None:
            _positive_int(self.d_ff, f"{self.name}: d_ff")

    @property
    def ffn_width(self) -> int:
        return 4 * self.d_model if self.d_ff is None else self.d_ff


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainSetup:
    """How a model is trained, for memory purposes.

    Attributes:
      policy: mixed-precision policy (``"p=f32,c=f16"``): params (the master copy) are stored in
        ``param_dtype``; the forward and backward run on a copy in ``compute_dtype``. When the two
        differ, both copies are counted (weights in compute dtype plus master weights).
      optimizer: one of :data:`OPTIMIZERS`.
      opt_dtype: dtype of the optimizer's moments; default: the param dtype.
      grad_dtype: dtype of the gradients; default: the compute dtype (as in fp16 training).
      batch: sequences per device per optimizer step.
      seq: sequence length; default: the model's.
      checkpoint_every: activation checkpointing every K layers (None: off).
      microbatches: gradient accumulation over M micro-batches of batch/M sequences; with M > 1
        a gradient accumulator in the param dtype is added.
      zero_stage: ZeRO-style sharding over ``dp`` data-parallel devices (Rajbhandari et al. 2020):
        1 shards optimizer state and master weights, 2 also gradients, 3 also weights.
      dp: data-parallel degree.
      dropout: count dropout outputs and 1-byte masks in the fuller activation count.
    """

    policy: Policy | str = "f32"
    optimizer: str = "adam"
    opt_dtype: Any = None
    grad_dtype: Any = None
    batch: int = 1
    seq: int | None = None
    checkpoint_every: int | None = None
    microbatches: int = 1
    zero_stage: int = 0
    dp: int = 1
    dropout: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", get_policy(self.policy))
        object.__setattr__(self, "optimizer", self.optimizer.lower())
        _optimizer(self.optimizer)
        for field in ("opt_dtype", "grad_dtype"):
            if getattr(self, field) is not None:
                object.__setattr__(self, field, parse_dtype(getattr(self, field)))
        _positive_int(self.batch, "batch")
        if self.seq is not None:
            _positive_int(self.seq, "seq")
        if self.checkpoint_every is not None:
            _positive_int(self.checkpoint_every, "checkpoint_every")
        _positive_int(self.microbatches, "microbatches")
        if self.batch % self.microbatches:
            raise ValueError(
                f"batch {self.batch} is not divisible into {self.microbatches} micro-batches"
            )
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be one of 0, 1, 2, 3, got {self.zero_stage!r}")
        _positive_int(self.dp, "dp")

    @property
    def param_dtype(self) -> np.dtype:
        return _policy(self).param_dtype

    @property
    def compute_dtype(self) -> np.dtype:
        return _policy(self).compute_dtype

    @property
    def state_dtype(self) -> np.dtype:
        return self.param_dtype if self.opt_dtype is None else self.opt_dtype

    @property
    def gradient_dtype(self) -> np.dtype:
        return self.compute_dtype if self.grad_dtype is None else self.grad_dtype


def _policy(setup: TrainSetup) -> Policy:
    assert isinstance(setup.policy, Policy)  # TrainSetup.__post_init__ parsed it
    return setup.policy


#: the byte counts of :attr:`Breakdown.model_states`
_MODEL_STATES = ("weights", "master_weights", "gradients", "grad_accumulator", "optimizer_state")


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """Bytes per device of one training step.

    ``activations_boundary`` is the textbook lower bound (only the layer-boundary tensors of
    batch x seq x d_model); ``activations_full`` counts what a transformer block saves for its
    backward pass (Korthikanti et al. 2022, Sec. 4.1) and is the one in ``total``.
    ``temporaries`` are the logits and their gradient (batch x seq x vocab).
    """

    # the boundary-only activation row is informative (``total`` counts the full one)
    _ROWS = (
        ("weights", "weights"),
        ("master weights", "master_weights"),
        ("gradients", "gradients"),
        ("gradient accumulator", "grad_accumulator"),
        ("optimizer state", "optimizer_state"),
        ("activations (boundary only)", "activations_boundary"),
        ("activations (transformer block)", "activations_full"),
        ("temporaries (logits)", "temporaries"),
        ("total", "total"),
    )

    n_params: int
    weights: int
    master_weights: int
    gradients: int
    grad_accumulator: int
    optimizer_state: int
    activations_boundary: int
    activations_full: int
    temporaries: int

    @property
    def model_states(self) -> int:
        """Weights, master weights, gradients (and accumulator) and optimizer state."""
        return byte_sum(self, _MODEL_STATES)

    @property
    def total(self) -> int:
        return self.model_states + self.activations_full + self.temporaries

    @property
    def bytes_per_param(self) -> float:
        """Model-state bytes per parameter (16 for fp16/fp32 mixed-precision Adam)."""
        return self.model_states / self.n_params

    def rows(self) -> list[tuple[str, int]]:
        """(label, bytes) in display order; the boundary-only activation row is informative."""
        return byte_rows(self, self._ROWS)

    def to_dict(self) -> dict[str, Any]:
        return byte_dict(self, ("model_states", "total", "bytes_per_param"))


def _nbytes(dtype: Any) -> int:
    return np.dtype(dtype).itemsize


def layer_activation_bytes(
    model: ModelSpec, *, batch: int, seq: int, dtype: Any, dropout: bool = False
) -> tuple[int, int]:
    """(boundary, full) bytes one transformer block keeps for the backward pass.

    boundary = batch x seq x d_model x bytes. full follows Korthikanti et al. 2022, Sec. 4.1,
    generalised to any activation dtype, MLP width and head width: with s, b, h, a, e = seq,
    batch, d_model, heads, bytes, it is e(16sbh + as^2b) without dropout; with dropout and
    e = 2 it is their 34sbh + 5as^2b.
    """
    e = _nbytes(dtype)
    s, b, h, a = seq, batch, model.d_model, model.n_heads
    ha, f = model.n_heads * model.d_head, model.ffn_width
    sb = s * b
    attention = e * (sb * h + 4 * sb * ha + a * s * s * b)  # LN out, Q, K, V, proj in, softmax
    mlp = e * (sb * h + 2 * sb * f)  # first linear input, GELU input and output
    norms = e * 2 * sb * h  # inputs of the two LayerNorms
    full = attention + mlp + norms
    if dropout:
        # Attention-dropout output in e bytes plus 1-byte masks (attention, projection, MLP).
        full += e * a * s * s * b + a * s * s * b + 2 * sb * h
    return sb * h * e, full


def _activations(
    model: ModelSpec, setup: TrainSetup, checkpoint_every: int | None
) -> tuple[int, int]:
    seq = setup.seq or model.seq_len
    micro = setup.batch // setup.microbatches
    boundary, full = layer_activation_bytes(
        model, batch=micro, seq=seq, dtype=setup.compute_dtype, dropout=setup.dropout
    )
    n = model.n_layers
    if checkpoint_every is None:
        return n * boundary, n * full
    k = min(checkpoint_every, n)
    segments = math.ceil(n / k)
    # Kept: one boundary tensor per segment; in the backward pass one segment of k layers is
    # recomputed and holds its own activations.
    return segments * boundary + k * boundary, segments * boundary + k * full


def estimate(model: ModelSpec, setup: TrainSetup) -> Breakdown:
    """Bytes per device of training ``model`` with ``setup``; see :class:`Breakdown`.

    Scalars (optimizer step counters, the loss scale) are left out: they are bytes, not bytes
    per parameter. :func:`estimate_step` counts them.
    """
    if setup.checkpoint_every is not None and setup.checkpoint_every > model.n_layers:
        raise ValueError(
            f"checkpoint_every={setup.checkpoint_every} exceeds the {model.n_layers} layers "
            f"of {model.name}; allowed: 1..{model.n_layers}"
        )
    n = model.n_params
    moments, _ = _optimizer(setup.optimizer)
    shard = math.ceil(n / setup.dp) if setup.zero_stage else n
    stage = setup.zero_stage
    mixed = setup.param_dtype != setup.compute_dtype
    weights = (shard if stage >= 3 else n) * _nbytes(setup.compute_dtype)
    master = (shard if stage >= 1 else n) * _nbytes(setup.param_dtype) if mixed else 0
    grads_n = shard if stage >= 2 else n
    grads = grads_n * _nbytes(setup.gradient_dtype)
    accumulator = grads_n * _nbytes(setup.param_dtype) if setup.microbatches > 1 else 0
    opt = moments * (shard if stage >= 1 else n) * _nbytes(setup.state_dtype)
    boundary, full = _activations(model, setup, setup.checkpoint_every)
    seq = setup.seq or model.seq_len
    micro = setup.batch // setup.microbatches
    policy = _policy(setup)
    logits = micro * seq * model.vocab
    temporaries = logits * (
        _nbytes(policy.output_dtype) + _nbytes(policy.op_dtype("cross_entropy"))
    )
    return Breakdown(
        n_params=n,
        weights=weights,
        master_weights=master,
        gradients=grads,
        grad_accumulator=accumulator,
        optimizer_state=opt,
        activations_boundary=boundary,
        activations_full=full,
        temporaries=temporaries,
    )


def best_checkpoint_interval(model: ModelSpec, setup: TrainSetup, *, full: bool = True) -> int:
    """The K in 1..n_layers with the least activation memory (the smallest K on ties).

    With the boundary-only count the cost is (ceil(N/K) + K) boundary tensors, least near
    K = sqrt(N); with the fuller count it is least near sqrt(N x boundary / block).
    """
    costs = {
        k: _activations(model, setup, k)[1 if full else 0] for k in range(1, model.n_layers + 1)
    }
    return min(costs, key=lambda k: (costs[k], k))


# --- a jitted step, as XLA sees it ---------------------------------------------------------


def tree_bytes(tree: Any, dtype: Any = None) -> int:
    """Bytes of the array leaves of ``tree`` (arrays or ``jax.ShapeDtypeStruct``), each in
    ``dtype`` if given, else in its own dtype; other leaves (an Equinox module's activation
    function, sizes) hold no array memory and count 0."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            continue
        size = int(np.prod(leaf.shape, dtype=np.int64))
        total += size * _nbytes(leaf.dtype if dtype is None else dtype)
    return total


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """Predicted ``memory_analysis()`` sizes of a jitted train step, in bytes.

    ``parts`` names the terms: params, optimizer_state, batch, metrics, tuple_table (arguments
    and outputs); gradients, compute_copy, activations, accumulator (temporaries).
    """

    arguments: int
    outputs: int
    temporaries: int
    parts: dict[str, int]


def estimate_step(
    params: Any,
    batch: Any,
    *,
    policy: Policy | str = "f32",
    optimizer: str = "adam",
    activation_bytes: int = 0,
    microbatches: int = 1,
    metrics: Any = None,
) -> StepEstimate:
    """What XLA should report for ``step(params, opt_state, batch) -> (params, opt_state,
    metrics)`` compiled with params and optimizer state donated.

    Arguments and outputs are exact byte counts: the params (as stored), the optimizer's moments
    (in the param dtype, as optax keeps them) and int32 step counters, the batch, the metrics,
    and for outputs XLA's tuple index table (one pointer per output leaf). Temporaries are an
    estimate: gradients in the param dtype, the compute-dtype copy of the params when it differs,
    the saved activations ``activation_bytes`` (of one micro-batch), and with micro-batches a
    gradient accumulator. ``metrics``: the step's other outputs (default: one float32 loss).
    """
    if metrics is None:  # the step's float32 loss
        metrics = (jax.ShapeDtypeStruct((), np.float32),)
    policy = get_policy(policy)
    moments, counters = _optimizer(optimizer)
    microbatches = _positive_int(microbatches, "microbatches")
    p_bytes = tree_bytes(params)
    n_leaves = len(jax.tree_util.tree_leaves(params))
    opt = moments * p_bytes + 4 * counters
    batch_bytes = tree_bytes(batch)
    metric_bytes = tree_bytes(metrics)
    out_leaves = n_leaves * (1 + moments) + counters + len(jax.tree_util.tree_leaves(metrics))
    table = POINTER_BYTES * out_leaves
    mixed = any(
        leaf.dtype != policy.compute_dtype
        for leaf in jax.tree_util.tree_leaves(params)
        if np.issubdtype(leaf.dtype, np.floating)
    )
    compute_copy = tree_bytes(params, policy.compute_dtype) if mixed else 0
    accumulator = p_bytes if microbatches > 1 else 0
    parts = {
        "params": p_bytes,
        "optimizer_state": opt,
        "batch": batch_bytes,
        "metrics": metric_bytes,
        "tuple_table": table,
        "gradients": p_bytes,
        "compute_copy": compute_copy,
        "activations": int(activation_bytes),
        "accumulator": accumulator,
    }
    return StepEstimate(
        arguments=p_bytes + opt + batch_bytes,
        outputs=p_bytes + opt + metric_bytes + table,
        temporaries=p_bytes + compute_copy + int(activation_bytes) + accumulator,
        parts=parts,
    )
