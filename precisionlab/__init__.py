"""precisionlab: exact, measured answers about number formats, quantization and mixed precision.

The curated top-level API; the submodules (``formats``, ``bits``, ``quant``, ``metrics``,
``mixed``, ``train``, ``memory``, ``experiments``) hold the rest. :func:`audit` says which
dtype each matmul and convolution of a function multiplies in
(:mod:`precisionlab.compute_audit`).
"""

from precisionlab.bits import (
    ROUNDING_MODES,
    Class,
    Rounding,
    classify,
    decode,
    encode,
    fields,
    round_to_format,
)
from precisionlab.compute_audit import audit
from precisionlab.formats import FloatFormat, IntFormat, Specials, format_names, get_format
from precisionlab.quant import QArray, dequantize, fake_quant, quantize

__version__ = "0.1.0"

__all__ = [
    "ROUNDING_MODES",
    "Class",
    "FloatFormat",
    "IntFormat",
    "QArray",
    "Rounding",
    "Specials",
    "audit",
    "classify",
    "decode",
    "dequantize",
    "encode",
    "fake_quant",
    "fields",
    "format_names",
    "get_format",
    "quantize",
    "round_to_format",
]
