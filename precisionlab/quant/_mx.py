"""The OCP Microscaling (MX) formats, v1.0.

OCP Microscaling Formats (MX) Specification v1.0 (2023), sections 5 and 6: a block of
k = 32 elements shares one scale X stored as E8M0 (an unsigned power of two, 2**-127 to
2**127, code 0xFF is NaN). Conversion (section 6.3): X = 2**(floor(log2(amax)) - emax_elem),
where emax_elem is the exponent of the element format's largest normal; elements are
x / X rounded to nearest even and saturated to the element format's max normal.

MXINT8 (section 5.3.3) stores 8-bit two's complement integers read as fixed point with an
implicit scale of 2**-6, so an element spans [-2, 1 63/64] and emax_elem = 0. By default we
saturate symmetrically to +-(1 63/64) (codes -127..127, the max-normal rule applied to
magnitudes, as the spec authors' reference implementation microsoft/microxcaling does), so -2
is not produced; ``quantize(..., full_range=True)`` uses code -128 (0x80) too, so
x/X in [-2, -1.9921875] rounds to its nearest code -2 instead of clamping to -1.984375.
"""

from __future__ import annotations

import dataclasses
import math

from precisionlab.formats import FORMATS, FloatFormat, Format, IntFormat

__all__ = ["MX_BLOCK_SIZE", "MX_FORMATS", "SCALE_RULES", "MXFormat", "get_mx_format"]

#: Elements sharing one E8M0 scale in the OCP MX v1.0 formats.
MX_BLOCK_SIZE = 32
#: Power-of-two scale rules (one vocabulary for quant and precisionlab.recipes):
#: "floor": OCP MX v1.0 section 6.3, X = 2**(floor(log2 amax) - emax_elem); elements above
#:   the element max saturate.
#: "ceil": torchao MX CEIL, X = 2**(ceil(log2 amax) - emax_elem).
#: "rceil": NVIDIA Transformer Engine / cuBLAS (torchao RCEIL, JAX scaled_dot_general),
#:   X = 2**ceil(log2(amax / max_elem)): never saturates, may waste up to a binade.
#: "even": torchao MX EVEN, amax rounded to the element's mantissa width first (add half a
#:   unit of the last kept bit, truncate), then the floor rule.
SCALE_RULES = ("floor", "ceil", "rceil", "even")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MXFormat:
    """An MX block format: element format, its emax, its max and the fixed-point shift.

    Attributes:
      name: e.g. ``"mxfp8_e4m3"``.
      element: the element format (a float format, or int8 for MXINT8).
      frac_bits: implicit fraction bits of integer elements (6 for MXINT8, 0 otherwise):
        element value = integer code * 2**-frac_bits.
      block_size: elements sharing one scale (32).
    """

    name: str
    element: Format
    frac_bits: int = 0
    block_size: int = MX_BLOCK_SIZE

    @property
    def elem_max(self) -> float:
        """Largest element magnitude after the fixed-point shift (448 for E4M3, 127/64)."""
        if isinstance(self.element, IntFormat):
            return math.ldexp(self.element.max, -self.frac_bits)
        return self.element.max

    @property
    def emax_elem(self) -> int:
        """Exponent of the element format's largest normal (8 for E4M3, 0 for MXINT8)."""
        if isinstance(self.element, FloatFormat):
            return self.element.emax
        return math.floor(math.log2(self.elem_max))

    @property
    def bits(self) -> int:
        return self.element.bits

    @property
    def bits_per_element(self) -> float:
        """Element bits plus the 8-bit scale spread over the block (8.25, 6.25, 4.25)."""
        return self.element.bits + 8 / self.block_size

    def __str__(self) -> str:
        return self.name


#: The OCP MX v1.0 formats by name (``mxfp8_e4m3``, ..., ``mxint8``).
MX_FORMATS: dict[str, MXFormat] = {
    f.name: f
    for f in (
        MXFormat(name="mxfp8_e4m3", element=FORMATS["float8_e4m3fn"]),
        MXFormat(name="mxfp8_e5m2", element=FORMATS["float8_e5m2"]),
        MXFormat(name="mxfp6_e2m3", element=FORMATS["float6_e2m3fn"]),
        MXFormat(name="mxfp6_e3m2", element=FORMATS["float6_e3m2fn"]),
        MXFormat(name="mxfp4", element=FORMATS["float4_e2m1fn"]),
        MXFormat(name="mxint8", element=FORMATS["int8"], frac_bits=6),
    )
}
_ALIASES = {"mxfp8": "mxfp8_e4m3", "mxfp6": "mxfp6_e2m3", "mxfp4_e2m1": "mxfp4"}


def get_mx_format(name: str | MXFormat) -> MXFormat | None:
    """The MX format of that name (or alias ``mxfp8``, ``mxfp6``), else None."""
    if isinstance(name, MXFormat):
        return name
    if not isinstance(name, str):
        return None
    key = name.strip().lower()
    return MX_FORMATS.get(_ALIASES.get(key, key))
