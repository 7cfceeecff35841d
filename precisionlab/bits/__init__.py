"""Bit-level codecs: encode values into any format's bit patterns and decode them back.

``encode``/``decode``/``fields``/``classify`` are vectorized and jittable (formats and modes
are static); :mod:`precisionlab.bits.reference` is the exact scalar reference.
"""

# First, before JAX's CPU threads allocate: malloc settings that keep big buffers resident.
from precisionlab import _alloc  # noqa: F401
from precisionlab.bits._codec import Class, classify, decode, encode, fields, round_to_format
from precisionlab.bits._rounding import ROUNDING_MODES, Rounding, parse_rounding

__all__ = [
    "ROUNDING_MODES",
    "Class",
    "Rounding",
    "classify",
    "decode",
    "encode",
    "fields",
    "parse_rounding",
    "round_to_format",
]
