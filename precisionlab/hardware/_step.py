"""One tensor-core step as data: what a matrix-multiply-accumulate instruction computes.

A step takes ``products`` pairs ``(a_i, b_i)`` and the incoming float32 accumulator ``c`` and
returns one float32 value (Khattak and Mikaitis 2025 call it a fused multiply-add of
"FMA size" ``products``; MMA-Sim a fused dot-add):

1. every product ``a_i * b_i`` is exact; its *alignment exponent* is ``e(a_i) + e(b_i)``, the
   sum of the inputs' exponents (not the product's own exponent, which may be one more);
   a subnormal input counts with its format's minimum exponent (``subnormal_inputs="emin"``)
   or is flushed to zero (``"flush"``); a zero product takes no part;
2. the largest alignment exponent ``E`` (including the accumulator's exponent when
   ``accumulator_in_alignment``) fixes a grid ``2**(E - fraction_bits)``; every addend is cut
   to that grid toward zero (``addend_rounding="toward_zero"``);
3. the cut addends are summed exactly;
4. the sum is normalised and kept to ``result_bits`` significant bits, toward zero, then
   stored as float32 (subnormal float32 results are cut to float32's grid, toward zero).

Block-scaled steps (``exact_group > 1``, Blackwell's ``kind::mxf4nvf4`` after MMA-Sim): the
products are first summed exactly in groups of ``exact_group`` (one block-scale pair each);
a group's addend is that sum times the two scales' significands, and its alignment exponent
is the sum of the two scales' exponents (whatever the products' own exponents, and even
when the group sums to zero). Steps 2-4 then run on the groups and the accumulator.

When the accumulator is not in the alignment, the products are summed as above without it
and the step's result is added to ``c`` in float32, rounded to nearest even.
"""

from __future__ import annotations

import dataclasses

__all__ = ["ROUNDINGS", "SUBNORMAL_MODES", "Step"]

ROUNDINGS = ("toward_zero",)
SUBNORMAL_MODES = ("emin", "flush")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Step:
    """A tensor-core step (see the module docstring). Frozen and hashable: a static argument.

    Attributes:
      products: products summed at once (the instruction's K, or half of it where the
        hardware splits the instruction into two fused steps).
      fraction_bits: bits kept below the largest alignment exponent (13 for Hopper FP8).
      addend_rounding: how addends are cut to that grid (only ``"toward_zero"`` is modelled).
      accumulator_in_alignment: whether ``c`` is aligned and cut with the products.
      result_bits: significant bits of the step's result (14 for Hopper FP8, 24 = float32).
      result_rounding: how the result is cut to ``result_bits`` (``"toward_zero"``).
      subnormal_inputs: ``"emin"`` (subnormal inputs keep their value, exponent = emin) or
        ``"flush"`` (treated as zero).
      exact_group: products summed exactly before alignment, with one block-scale pair
        (1: every product is its own addend; 16: Blackwell's block-scaled FP4 step).
    """

    products: int
    fraction_bits: int
    addend_rounding: str = "toward_zero"
    accumulator_in_alignment: bool = True
    result_bits: int = 24
    result_rounding: str = "toward_zero"
    subnormal_inputs: str = "emin"
    exact_group: int = 1

    def __post_init__(self) -> None:
        for name in ("products", "fraction_bits", "result_bits", "exact_group"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Step.{name} must be a positive int, got {v!r}")
        if self.products % self.exact_group:
            raise ValueError(
                f"Step.exact_group {self.exact_group} must divide products {self.products}"
            )
        if self.result_bits > 24:
            raise ValueError(f"Step.result_bits must be <= 24 (float32), got {self.result_bits}")
        for name in ("addend_rounding", "result_rounding"):
            if getattr(self, name) not in ROUNDINGS:
                raise ValueError(
                    f"Step.{name} {getattr(self, name)!r} is not modelled; allowed: "
                    + ", ".join(ROUNDINGS)
                )
        if self.subnormal_inputs not in SUBNORMAL_MODES:
            raise ValueError(
                f"Step.subnormal_inputs {self.subnormal_inputs!r}; allowed: "
                + ", ".join(SUBNORMAL_MODES)
            )
        if not isinstance(self.accumulator_in_alignment, bool):
            raise ValueError("Step.accumulator_in_alignment must be true or false")
