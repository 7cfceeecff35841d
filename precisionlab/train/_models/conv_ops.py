"""The math of the small convolutional classifier behind the ``conv`` model (``ConvNet``).

``x f32[B, in_dim]`` is read as a square one-channel image ``[B, S, S, 1]`` (``S * S ==
in_dim``; row-major, as ``digits`` flattens its 8x8 images), then ``depth`` blocks of
``3x3 conv (SAME) -> * act_scale -> relu|gelu|tanh -> 2x2 max pool`` (the pool only while the side
is even and > 1) with ``width * 2**i`` channels, then a dense layer to ``num_classes`` logits.

Every op runs in the policy's compute dtype through :mod:`precisionlab.mixed.ops`: convolutions
via :func:`~precisionlab.mixed.ops.conv2d` (operands in the compute dtype, float32 accumulation,
one rounding, then the bias add rounded), so forced per-op numerics match the MLP's. Max pooling
picks an element and needs no rounding.

Pure functions of the config object ``cfg`` (any object with the ``ConvNet`` fields), so this
module does not import the model base class.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from precisionlab.mixed import ops
from precisionlab.mixed._policy import Policy
from precisionlab.train._models._activation import activate, fp32_compute

__all__ = ["forward", "image_side", "init_params"]


def image_side(in_dim: int) -> int:
    """The side S of the square image with ``in_dim`` pixels (ValueError if not a square)."""
    side = math.isqrt(in_dim)
    if side * side != in_dim:
        raise ValueError(
            f"conv model: in_dim must be a square number of pixels (S * S, one channel), "
            f"got {in_dim}"
        )
    return side


def _layout(cfg: Any) -> tuple[list[tuple[int, int, bool]], int]:
    """Per block ``(c_in, c_out, pool)`` and the flattened size fed to the output layer."""
    side, c_in, blocks = image_side(cfg.in_dim), 1, []
    for i in range(cfg.depth):
        c_out = cfg.width * 2**i
        pool = side % 2 == 0 and side > 1
        blocks.append((c_in, c_out, pool))
        side, c_in = (side // 2 if pool else side), c_out
    return blocks, side * side * c_in


def init_params(cfg: Any, keys: list[Any]) -> dict[str, Any]:
    """Float32 params from ``depth + 1`` generators ``keys`` (each with ``normal(shape, std)``).

    Kernels [3, 3, c_in, c_out] with std ``init_scale * gain / sqrt(9 c_in)`` (gain sqrt 2 for
    relu, He), zero biases; output [flat, num_classes] with std ``init_scale / sqrt(flat)``."""
    blocks, flat = _layout(cfg)
    gain = math.sqrt(2.0) if cfg.activation == "relu" else 1.0
    convs = [
        {
            "w": keys[i].normal((3, 3, ci, co), cfg.init_scale * gain / math.sqrt(9 * ci)),
            "b": keys[i].zeros((co,)),
        }
        for i, (ci, co, _) in enumerate(blocks)
    ]
    out = {
        "w": keys[-1].normal((flat, cfg.num_classes), cfg.init_scale / math.sqrt(flat)),
        "b": keys[-1].zeros((cfg.num_classes,)),
    }
    return {"convs": convs, "out": out}


def forward(
    cfg: Any, params: dict[str, Any], inputs: jax.Array, pol: Policy
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Logits [B, num_classes] in the compute dtype and a dict of per-block activations in the
    compute dtype: ``conv{i}/pre``, ``conv{i}/out``."""
    blocks, _ = _layout(cfg)
    side = image_side(cfg.in_dim)
    acts: dict[str, jax.Array] = {}
    h = ops.boundary(inputs, pol).reshape(-1, side, side, 1)

    def block(
        layer: Any, h: jax.Array, pool: bool, pol: Policy = pol
    ) -> tuple[jax.Array, jax.Array]:
        z = ops.conv2d(h, layer["w"], layer["b"], policy=pol)
        if cfg.act_scale != 1.0:
            z = ops.boundary(z * jnp.asarray(cfg.act_scale, z.dtype), pol)
        a = activate(cfg.activation, z, pol)
        if pool:  # 2x2 max pool: selects an element, exact in any dtype
            b_, s, _, c = a.shape
            a = a.reshape(b_, s // 2, 2, s // 2, 2, c).max(axis=(2, 4))
        return z, a

    hp = getattr(cfg, "high_precision", ())
    for i, (layer, (_, _, pool)) in enumerate(zip(params["convs"], blocks, strict=True)):
        # a layer kept in high precision computes in float32 (models.Model.layer_names)
        fn = partial(block, pol=fp32_compute(pol) if f"conv{i}" in hp else pol)
        run = jax.checkpoint(fn, static_argnums=2) if cfg.remat else fn
        with jax.named_scope(f"conv{i}"):
            z, h = run(layer, h, pool)
        acts[f"conv{i}/pre"] = z
        acts[f"conv{i}/out"] = h
    h = h.reshape(h.shape[0], -1)
    with jax.named_scope("out"):
        lp = fp32_compute(pol) if "out" in hp else pol
        logits = ops.dense(h, params["out"]["w"], params["out"]["b"], policy=lp)
    return logits, acts
