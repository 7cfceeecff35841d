"""``conv``: small CNN classifier (the math lives in :mod:`precisionlab.train._models.conv_ops`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from precisionlab.mixed._policy import Policy
from precisionlab.train._models import conv_ops as _conv
from precisionlab.train._models.base import (
    MAX_DEPTH,
    Gen,
    Model,
    check_int,
    check_layout,
    check_scales,
    normal_init,
)

__all__ = ["ConvNet"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConvNet(Model):
    """Small convolutional classifier of square one-channel images given flat as ``x f32[B,
    in_dim]`` (the math lives in :mod:`precisionlab.train.conv`); logits [B, num_classes]."""

    in_dim: int = 64
    num_classes: int = 10
    width: int = 16
    depth: int = 2
    activation: str = "relu"
    init_scale: float = 1.0
    act_scale: float = 1.0
    remat: bool = False
    high_precision: tuple[str, ...] = ()

    name = "conv"
    data_kind = "classification"

    def __post_init__(self) -> None:
        for n in ("in_dim", "width"):
            check_int(n, getattr(self, n), 1)
        check_int("depth", self.depth, 1, MAX_DEPTH)
        check_int("num_classes", self.num_classes, 2)
        check_scales(self)
        _conv.check(self)
        check_layout(self, None)  # no scan_layers

    def layer_names(self) -> tuple[str, ...]:
        return (*(f"conv{i}" for i in range(self.depth)), "out")

    def layer_params(self, name: str) -> str:
        return "['out']" if name == "out" else f"['convs'][{int(name[4:])}]"

    def _init(self, gen: Gen) -> dict[str, Any]:
        return _conv.init_params(self, gen.split(self.depth + 1), normal_init)

    def apply(
        self,
        params: Any,
        inputs: jax.Array,
        policy: Policy | None = None,
        *,
        capture: bool = False,
        enforce: bool = True,
    ) -> Any:
        return _conv.apply(self, params, inputs, policy, capture=capture, enforce=enforce)

    def _inputs_labels(self, batch: dict[str, Any]) -> tuple[jax.Array, jax.Array]:
        return batch["x"], batch["y"]

    def example_batch(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        return {
            "x": jax.ShapeDtypeStruct((batch_size, self.in_dim), jnp.float32),
            "y": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
        }
