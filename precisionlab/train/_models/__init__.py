"""Built-in models in plain JAX with an explicit dtype flow that honours a Policy.

Params are float32 pytrees of dicts and lists (cast by the train step to the storage and compute
dtypes). Every op goes through :mod:`precisionlab.mixed.ops`, so the compute dtype's rounding and
overflow are forced at op boundaries and the policy's float32 list is honoured.

- ``mlp``: classifier ``x -> [dense -> (LayerNorm) -> * act_scale -> relu|gelu|tanh] * depth ->
  dense``. Shapes: x f32[B, in_dim] -> logits [B, num_classes].
- ``transformer``: decoder-only LM; token + learned position embedding, ``depth`` pre-LayerNorm
  blocks (causal softmax attention with ``heads`` heads, GELU MLP of ``mlp_ratio * d_model``),
  final LayerNorm, unembedding. Shapes: tokens i32[B, T] -> logits [B, T, vocab_size].
- ``conv``: small CNN classifier (:mod:`precisionlab.train._models.conv_ops`): x f32[B, in_dim]
  read as an S x S one-channel image -> [3x3 conv -> act -> 2x2 max pool] * depth -> dense.
  Convolutions in the compute dtype with the same per-op rounding (``ops.conv2d``).

Knobs for precision experiments: ``init_scale`` (multiplies every initial weight's std),
``use_layernorm`` (False removes the normalisation: activations can grow), ``act_scale``
(multiplies pre-activations), ``remat`` (``jax.checkpoint`` around each block),
``scan_layers`` / ``remat_every`` / ``remat_policy`` (mlp, transformer: the identical layers
stacked and run under ``lax.scan``, checkpointed every K layers, see
:mod:`precisionlab.train._layers`; the mlp's first layer, of another shape, stays unrolled),
``outlier_channels`` / ``outlier_scale`` (transformer: the first channels of every block's
normalised inputs to the qkv and fc1 matmuls multiplied by the scale, the outlier features
LLM.int8() reports in large models, for low-precision matmul recipes). The loss is
weighted by the trainer (``TrainConfig.loss_weight``), not by the model.

Layers: every model names its layers (:meth:`Model.layer_names`: ``layer0``.. and ``out`` for
the MLP, ``block0``.. and ``unembed`` for the transformer, ``conv0``.. and ``out`` for the CNN)
and runs each under ``jax.named_scope(name)``, so the interception layer's sites carry the
layer's name as their scope. ``high_precision`` (a tuple of layer names) computes those layers
in float32 whatever the policy's compute dtype (their inputs are cast up, their outputs go on in
float32 to the next layer, which casts them down): the "return a layer to high precision" of
``precisionlab diagnose`` (``TrainConfig.high_precision_layers``). ``overflow_layer`` /
``overflow_scale`` (MLP, a diagnose test knob): that hidden layer's pre-activations are
multiplied by the scale and its activations divided by it (exact with relu and a power-of-two
scale: the identity in float32; past float16's max in float16).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any

from precisionlab._schema import check_int
from precisionlab.train import _registry as registry
from precisionlab.train._models.base import MAX_DEPTH, MODELS, Model
from precisionlab.train._models.conv import ConvNet
from precisionlab.train._models.mlp import MLP
from precisionlab.train._models.transformer import Transformer

__all__ = [
    "MAX_DEPTH",
    "MLP",
    "MODELS",
    "ConvNet",
    "Model",
    "Transformer",
    "layer_names",
    "make_model",
    "model_data_kind",
    "resolve_layers",
]

_BUILDERS: dict[str, type[Model]] = {"mlp": MLP, "transformer": Transformer, "conv": ConvNet}


def make_model(name: str, **kwargs: Any) -> Model:
    """Build a model by name (see :data:`MODELS`); unknown options raise ValueError."""
    return registry.build(_BUILDERS, name, "model", kwargs)


def model_data_kind(name: str) -> str:
    """The kind of dataset (``"classification"`` or ``"lm"``) the model ``name`` reads."""
    kind = registry.lookup(_BUILDERS, name, "model").data_kind
    if not kind:
        raise ValueError(f"model {name!r} does not declare the data_kind it reads")
    return kind


def layer_names(name: str, model_kwargs: dict[str, Any] | None = None) -> tuple[str, ...]:
    """The layer names of model ``name`` with ``model_kwargs`` (only ``depth`` matters; the
    data's sizes need not be known)."""
    cls = registry.lookup(_BUILDERS, name, "model")
    fields = {f.name: f.default for f in dataclasses.fields(cls)}  # type: ignore[arg-type]  # the registered models are dataclasses
    depth = (model_kwargs or {}).get("depth", fields["depth"])
    check_int("depth", depth, 1, MAX_DEPTH)
    prefix, last = {"mlp": ("layer", "out"), "transformer": ("block", "unembed")}.get(
        name, ("conv", "out")
    )
    return (*(f"{prefix}{i}" for i in range(depth)), last)


def resolve_layers(
    patterns: Any, names: tuple[str, ...], what: str = "layer filter"
) -> tuple[str, ...]:
    """The layers of ``names`` matched by any glob of ``patterns`` (``"layer*"``), in program
    order; a pattern matching no layer is a ValueError naming the layers."""
    if isinstance(patterns, str):
        patterns = [patterns]
    if not all(isinstance(p, str) for p in patterns):
        raise ValueError(f"{what} must be a list of layer names or glob patterns, got {patterns!r}")
    for p in patterns:
        if not fnmatch.filter(names, p):
            raise ValueError(f"{what} {p!r} matches no layer; layers: {', '.join(names)}")
    return tuple(n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns))
