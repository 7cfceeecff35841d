"""``conv``: small CNN classifier (the math lives in :mod:`precisionlab.train._models.conv_ops`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from precisionlab.mixed._policy import Policy
from precisionlab.train._models import conv_ops as _conv
from precisionlab.train._models.base import Classifier, Gen

__all__ = ["ConvNet"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConvNet(Classifier):
    """Small convolutional classifier of square one-channel images given flat as ``x f32[B,
    in_dim]`` (the math lives in :mod:`precisionlab.train._models.conv_ops`); logits [B,
    num_classes]."""

    in_dim: int = 64
    width: int = 16
    remat: bool = False
    high_precision: tuple[str, ...] = ()

    name = "conv"

    def __post_init__(self) -> None:
        self._check_options()
        _conv.image_side(self.in_dim)
        self._check_layout(None)  # no scan_layers

    def layer_names(self) -> tuple[str, ...]:
        return (*(f"conv{i}" for i in range(self.depth)), "out")

    def layer_params(self, name: str) -> str:
        return "['out']" if name == "out" else f"['convs'][{int(name[4:])}]"

    def _init(self, gen: Gen) -> dict[str, Any]:
        return _conv.init_params(self, gen.split(self.depth + 1))

    def _forward(
        self, params: Any, inputs: jax.Array, pol: Policy, capture: bool
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        return _conv.forward(self, params, inputs, pol)
