"""Quantization: tensors to codes plus scales and back, MX block formats, fake_quant.

- :func:`quantize` / :func:`dequantize`: per-tensor, per-channel or per-block scales;
  symmetric or asymmetric ints, scaled floats, and the OCP MX formats.
- :func:`fake_quant`: both in one jittable op with a straight-through gradient; also the
  4-bit training recipes' quantizers by name (:data:`FP4_QUANTIZERS`,
  :mod:`precisionlab.quant.fp4`).
- :class:`QArray`: the quantized pytree (codes, scales, zero points, static metadata).
- :class:`QuantOptions`: the options quantize and fake_quant take as keywords.
- :func:`pack` / :func:`unpack`: two 4-bit codes per byte.

Every element conversion goes through the codecs of :mod:`precisionlab.bits`.
"""

from precisionlab.quant._fake_quant import STE_MODES, fake_quant
from precisionlab.quant._mx import MX_BLOCK_SIZE, MX_FORMATS, SCALE_RULES, MXFormat, get_mx_format
from precisionlab.quant._pack import pack, unpack
from precisionlab.quant._qarray import SCALE_FORMATS, QArray
from precisionlab.quant._quantize import dequantize, element_scales, quantize
from precisionlab.quant._spec import SCALE_METHODS, SCHEMES, QuantOptions
from precisionlab.quant.fp4 import FP4_QUANTIZERS

__all__ = [
    "FP4_QUANTIZERS",
    "MX_BLOCK_SIZE",
    "MX_FORMATS",
    "SCALE_FORMATS",
    "SCALE_METHODS",
    "SCALE_RULES",
    "SCHEMES",
    "STE_MODES",
    "MXFormat",
    "QArray",
    "QuantOptions",
    "dequantize",
    "element_scales",
    "fake_quant",
    "get_mx_format",
    "pack",
    "quantize",
    "unpack",
]
