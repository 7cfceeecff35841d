"""``mlp``: classifier ``x -> [dense -> (LayerNorm) -> * act_scale -> relu|gelu|tanh] * depth ->
dense``; x f32[B, in_dim] -> logits [B, num_classes] (options:
:mod:`precisionlab.train._models`)."""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from precisionlab.mixed import ops
from precisionlab.mixed._policy import Policy
from precisionlab.quant import MX_FORMATS, fake_quant, get_mx_format
from precisionlab.train._layers import scan_layers, unstack_layers
from precisionlab.train._models._activation import activate
from precisionlab.train._models.base import Classifier, Gen, stack_init

__all__ = ["MLP"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLP(Classifier):
    """MLP classifier (see module docstring)."""

    use_layernorm: bool = False
    remat: bool = False
    high_precision: tuple[str, ...] = ()
    overflow_layer: int = -1
    overflow_scale: float = 2.0**20
    scan_layers: bool = False
    remat_every: int = 0
    remat_policy: str = "nothing_saveable"
    norm_format: str | None = None

    name = "mlp"

    def __post_init__(self) -> None:
        self._check_options("overflow_scale")
        if (
            isinstance(self.overflow_layer, bool)  # true was silently layer 1
            or not isinstance(self.overflow_layer, int)
            or not -1 <= self.overflow_layer < self.depth
        ):
            raise ValueError(
                f"overflow_layer must be -1 (off) or a hidden layer 0..{self.depth - 1}, "
                f"got {self.overflow_layer!r}"
            )
        if self.norm_format is not None:
            if get_mx_format(self.norm_format) is None:
                raise ValueError(
                    f"unknown norm_format {self.norm_format!r}; allowed: {', '.join(MX_FORMATS)}"
                )
            if not self.use_layernorm or self.width % 32:
                raise ValueError(
                    "norm_format quantizes the LayerNorm weights in blocks of 32 channels: it "
                    f"needs use_layernorm = true and a width multiple of 32, got "
                    f"use_layernorm={self.use_layernorm}, width={self.width}"
                )
        self._check_layout(self.depth - 1)  # layer 0 (in_dim -> width) is not stacked
        if self.scan_layers and self.overflow_layer >= 1:
            raise ValueError(
                f"overflow_layer {self.overflow_layer} is a stacked layer under scan_layers; "
                "use the unrolled layers (scan_layers=False)"
            )

    def layer_names(self) -> tuple[str, ...]:
        return (*(f"layer{i}" for i in range(self.depth)), "out")

    def layer_params(self, name: str) -> str:
        return "['out']" if name == "out" else f"['hidden'][{int(name[5:])}]"

    def _init(self, gen: Gen) -> dict[str, Any]:
        keys = gen.split(self.depth + 1)
        gain = math.sqrt(2.0) if self.activation == "relu" else 1.0
        hidden = []
        fan_in = self.in_dim
        for i in range(self.depth):
            layer = {
                "w": keys[i].normal(
                    (fan_in, self.width), self.init_scale * gain / math.sqrt(fan_in)
                ),
                "b": keys[i].zeros((self.width,)),
            }
            if self.use_layernorm:
                layer["ln_scale"] = keys[i].ones((self.width,))
                layer["ln_bias"] = keys[i].zeros((self.width,))
            hidden.append(layer)
            fan_in = self.width
        out = {
            "w": keys[-1].normal((fan_in, self.num_classes), self.init_scale / math.sqrt(fan_in)),
            "b": keys[-1].zeros((self.num_classes,)),
        }
        params = {"hidden": hidden, "out": out}
        return self.stack_params(params) if self.scan_layers else params

    def stack_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """Params in the ``scan_layers`` layout: hidden layers 1.. stacked under
        ``"hidden_stack"`` (leaves ``[depth - 1, ...]``); layer 0 stays in ``"hidden"``."""
        if "hidden_stack" in params or len(params["hidden"]) < 2:
            return params
        rest = stack_init(list(params["hidden"][1:]), "hidden layer")
        return {**params, "hidden": list(params["hidden"][:1]), "hidden_stack": rest}

    def unstack_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """The inverse of :meth:`stack_params`: one dict per hidden layer in ``"hidden"``."""
        if "hidden_stack" not in params:
            return params
        out = {k: v for k, v in params.items() if k != "hidden_stack"}
        out["hidden"] = list(params["hidden"]) + unstack_layers(params["hidden_stack"])
        return out

    def _forward(
        self, params: Any, inputs: jax.Array, pol: Policy, capture: bool
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        acts: dict[str, jax.Array] = {}
        h = ops.boundary(inputs, pol)

        def block(
            layer: Any,
            h: jax.Array,
            pol: Policy = pol,
            overflow: bool = False,
            quant_norm: bool = True,
        ) -> tuple[jax.Array, jax.Array]:
            z = ops.dense(h, layer["w"], layer["b"], policy=pol)
            if self.use_layernorm:
                scale, bias = layer["ln_scale"], layer["ln_bias"]
                if self.norm_format is not None and quant_norm:  # MX-quantized affine weights

                    def q(v: jax.Array) -> jax.Array:
                        return fake_quant(v.astype(jnp.float32), self.norm_format, axis=-1,
                                          ste="identity")  # fmt: skip

                    scale, bias = q(scale), q(bias)
                z = ops.layer_norm(z, scale, bias, policy=pol)
            if self.act_scale != 1.0:
                z = ops.boundary(z * jnp.asarray(self.act_scale, z.dtype), pol)
            if overflow:  # the diagnose test knob: z * S, then act(z * S) / S, in float32
                s = jnp.float32(self.overflow_scale)  # each product rounded to the compute dtype
                z = ops.boundary(z.astype(jnp.float32) * s, pol)
                a = activate(self.activation, z, pol).astype(jnp.float32) / s
                return z, ops.boundary(a, pol)
            return z, activate(self.activation, z, pol)

        def record(i: int, z: jax.Array, h: jax.Array) -> None:
            acts[f"layer{i}/pre"] = z
            if self.activation == "gelu":  # tanh-GELU's x**3 overflows float16 first (|x| > 40)
                acts[f"layer{i}/gelu_cubic"] = z**3
            acts[f"layer{i}/out"] = h

        if self.scan_layers:
            unrolled = params["hidden"][:1]
            stacked = params.get("hidden_stack", list(params["hidden"][1:]))
        else:
            unrolled = self.unstack_params(params)["hidden"]
        for i, layer in enumerate(unrolled):
            lp = self._layer_policy(f"layer{i}", pol)
            fn = partial(
                block, pol=lp, overflow=i == self.overflow_layer,
                quant_norm=f"layer{i}" not in self.high_precision,
            )  # fmt: skip
            with jax.named_scope(f"layer{i}"):
                z, h = (jax.checkpoint(fn) if self.remat else fn)(layer, h)
            record(i, z, h)
        if self.scan_layers and self.depth > 1:

            def body(layer: Any, h: jax.Array) -> tuple[jax.Array, Any]:
                z, h = block(layer, h)
                return h, ((z, h) if capture else None)

            h, ys = scan_layers(
                body,
                stacked,
                h,
                remat_every=self.remat_every,
                policy=self.remat_policy,
                what="hidden layer",
                scope="layer",
                first=1,
            )
            for i in range(1, self.depth if capture else 1):
                record(i, ys[0][i - 1], ys[1][i - 1])
        with jax.named_scope("out"):
            lp = self._layer_policy("out", pol)
            logits = ops.dense(h, params["out"]["w"], params["out"]["b"], policy=lp)
        return logits, acts
