"""QArray: quantized codes, their scales and zero points, and how to read them back."""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import numpy as np

from precisionlab.formats import Format
from precisionlab.quant._mx import MXFormat

__all__ = ["SCALE_FORMATS", "QArray"]

#: How scales are stored: float32 values; float16 / bfloat16 codes (rounded up, so the
#: clip value still fits); "pow2": float32 values that are powers of two; "e8m0": uint8 E8M0
#: codes (powers of two, 2**-127..2**127, 0xFF is NaN), as the MX formats store them.
SCALE_FORMATS = ("float32", "float16", "bfloat16", "pow2", "e8m0")
_SCALE_BITS = {"float32": 32, "float16": 16, "bfloat16": 16, "pow2": 32, "e8m0": 8}


@partial(
    jax.tree_util.register_dataclass,
    data_fields=["codes", "scales", "zero_points"],
    meta_fields=[
        "fmt",
        "shape",
        "granularity",
        "axis",
        "block_size",
        "scheme",
        "scale_method",
        "scale_format",
        "scale_rule",
        "rounding",
        "packed",
        "dtype",
    ],
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class QArray:
    """A quantized array: a pytree whose leaves are the codes, scales and zero points.

    The value of element ``i`` is ``(decode(codes[i]) - zero_point[g]) * scale[g]`` for the
    group ``g`` that holds it (the whole tensor, one index along ``axis``, or one block of
    ``block_size`` consecutive elements along ``axis``). Everything else is static metadata,
    so a QArray passes through ``jax.jit`` and ``jax.vmap`` boundaries.

    Attributes:
      codes: codes of ``fmt``'s element format (uint8/uint16/uint32), shape ``shape``; or,
        when ``packed``, the flattened codes two per byte (uint8, ``ceil(size / 2)``).
      scales: per-group scales: shape ``()`` (tensor), ``(shape[axis],)`` (channel), or
        ``shape`` with ``shape[axis]`` replaced by the number of blocks (block). float32
        values, or codes of ``scale_format`` (uint16 for float16/bfloat16, uint8 for e8m0).
      zero_points: None (symmetric) or integer zero points stored as codes of the element
        format, shaped like ``scales``.
      fmt: the element format, or the :class:`MXFormat`.
      granularity: ``"tensor"``, ``"channel"`` or ``"block"``.
      scale_rule: ``"floor"``, ``"ceil"``, ``"rceil"`` or ``"even"`` for power-of-two
        scales, else None.
    """

    codes: jax.Array
    scales: jax.Array
    zero_points: jax.Array | None
    fmt: Format | MXFormat
    shape: tuple[int, ...]
    granularity: str
    axis: int | None
    block_size: int | None
    scheme: str
    scale_method: str
    scale_format: str
    scale_rule: str | None
    rounding: str
    packed: bool
    dtype: str

    @property
    def element_format(self) -> Format:
        return self.fmt.element if isinstance(self.fmt, MXFormat) else self.fmt

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def granularity_spec(self) -> str:
        """``"tensor"``, ``"channel:AXIS"`` or ``"block:B"`` (as the survey spells it)."""
        if self.granularity == "channel":
            return f"channel:{self.axis}"
        if self.granularity == "block":
            return f"block:{self.block_size}"
        return "tensor"

    @property
    def nbytes(self) -> int:
        """Bytes actually held: codes (packed if so) + scales + zero points."""
        total = int(np.prod(self.codes.shape)) * np.dtype(self.codes.dtype).itemsize
        total += int(np.prod(self.scales.shape)) * np.dtype(self.scales.dtype).itemsize
        if self.zero_points is not None:
            zp = self.zero_points
            total += int(np.prod(zp.shape)) * np.dtype(zp.dtype).itemsize
        return total

    @property
    def bits_per_element(self) -> float:
        """Nominal storage per element: element bits plus scale and zero-point bits spread
        over the elements (int4 per-group-128 with float32 scales: 4.25; float16: 4.125;
        MXFP4: 4.25). Zero points count at the element width."""
        n = max(self.size, 1)
        bits = self.element_format.bits * self.size
        n_scales = int(np.prod(self.scales.shape))
        if self.scale_method != "none":  # a plain cast stores no meaningful scale
            bits += _SCALE_BITS[self.scale_format] * n_scales
        if self.zero_points is not None:
            bits += self.element_format.bits * n_scales
        return bits / n

    def describe(self) -> dict:
        """Static metadata as a JSON-able dict (recorded in every report)."""
        return {
            "format": str(self.fmt),
            "shape": list(self.shape),
            "granularity": self.granularity_spec,
            "scheme": self.scheme,
            "scale": self.scale_method,
            "scale_format": self.scale_format,
            "scale_rule": self.scale_rule,
            "rounding": self.rounding,
            "packed": self.packed,
            "bits_per_element": self.bits_per_element,
            "nbytes": self.nbytes,
        }

    def __repr__(self) -> str:
        return (
            f"QArray(fmt={self.fmt}, shape={self.shape}, granularity={self.granularity_spec}, "
            f"scheme={self.scheme}, scale={self.scale_method}, scale_format={self.scale_format}"
            + (f", scale_rule={self.scale_rule}" if self.scale_rule else "")
            + f", bits_per_element={self.bits_per_element:g})"
        )
