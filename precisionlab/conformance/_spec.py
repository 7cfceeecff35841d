"""The spec text each classification rests on.

Quotations marked ``quote`` are the standards' own words (IEEE 754-2019 keeps the 2008 wording
of these clauses); text marked ``paraphrase`` states what the cited section says without
quoting it. The formats' tables (which codes exist) are the spec's tables as encoded in
:mod:`precisionlab.formats`.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["SPECS", "Spec", "rounding_spec", "spec_for_format"]


class Spec(NamedTuple):
    source: str  # document and section
    text: str
    kind: str  # "quote" or "paraphrase"


IEEE = "IEEE 754-2019"
OFP8 = "OCP 8-bit Floating Point Specification (OFP8) rev. 1.0"
MX = "OCP Microscaling Formats (MX) Specification v1.0"

SPECS: dict[str, Spec] = {
    "ieee-5.1": Spec(
        f"{IEEE} §5.1",
        "each of the computational operations specified by this standard that returns a "
        "numeric result shall be performed as if it first produced an intermediate result "
        "correct to infinite precision and with unbounded range, and then rounded that "
        "intermediate result, if necessary, to fit in the destination's format (see Clause 4 "
        "and Clause 7)",
        "quote",
    ),
    "ieee-4.3.1-even": Spec(
        f"{IEEE} §4.3.1",
        "roundTiesToEven, the floating-point number nearest to the infinitely precise result "
        "shall be delivered; if the two nearest floating-point numbers bracketing an "
        "unrepresentable infinitely precise result are equally near, the one with an even "
        "least significant digit shall be delivered",
        "quote",
    ),
    "ieee-4.3.1-away": Spec(
        f"{IEEE} §4.3.1",
        "roundTiesToAway, the floating-point number nearest to the infinitely precise result "
        "shall be delivered; if the two nearest floating-point numbers bracketing an "
        "unrepresentable infinitely precise result are equally near, the one with larger "
        "magnitude shall be delivered",
        "quote",
    ),
    "ieee-4.3.2-up": Spec(
        f"{IEEE} §4.3.2",
        "roundTowardPositive, the result shall be the format's floating-point number (possibly "
        "+∞) closest to and no less than the infinitely precise result",
        "quote",
    ),
    "ieee-4.3.2-down": Spec(
        f"{IEEE} §4.3.2",
        "roundTowardNegative, the result shall be the format's floating-point number (possibly "
        "−∞) closest to and no greater than the infinitely precise result",
        "quote",
    ),
    "ieee-4.3.2-zero": Spec(
        f"{IEEE} §4.3.2",
        "roundTowardZero, the result shall be the format's floating-point number closest to "
        "and no greater in magnitude than the infinitely precise result",
        "quote",
    ),
    "ieee-4.3-sign": Spec(
        f"{IEEE} §4.3",
        "Inexact numeric floating-point results always have the same sign as the unrounded result.",
        "quote",
    ),
    "ieee-7.4": Spec(
        f"{IEEE} §7.4",
        "a) roundTiesToEven and roundTiesToAway carry all overflows to ∞ with the sign of the "
        "intermediate result. b) roundTowardZero carries all overflows to the format's largest "
        "finite number with the sign of the intermediate result.",
        "quote",
    ),
    "ieee-6.2": Spec(
        f"{IEEE} §6.2",
        "an operation with a quiet NaN input that delivers a floating-point result delivers a "
        "quiet NaN (a NaN converts to a NaN; its payload and sign are not prescribed)",
        "paraphrase",
    ),
    "ocp8-sat": Spec(
        f"{OFP8}, Table 3 (conversion from wider formats)",
        "conversions into E4M3/E5M2 are defined for round-to-nearest-even, in two modes: "
        "saturating, where values beyond the largest normal and infinities become the largest "
        "normal of the same sign, and non-saturating, where they become Inf (E5M2) or NaN "
        "(E4M3, which has no Inf); both are allowed, so the choice is the library's "
        "convention (as read by ml_dtypes issue #147, gfloat PR #1, riscv-isa-sim issue #2284)",
        "paraphrase",
    ),
    "mx-fp6-fp4": Spec(
        f"{MX} §5.3.3 (FP6 and FP4 element types)",
        "no encodings for Inf or NaN",
        "quote",
    ),
    "mx-e8m0": Spec(
        f"{MX} §5.4.1 (E8M0 scale type)",
        "an unsigned 8-bit exponent with bias 127 (2^-127 .. 2^127), 0xFF is NaN; there is no "
        "sign, no zero and no infinity; the spec gives no rule for converting other numbers "
        "into E8M0 (libraries differ: ml_dtypes issue #298; ONNX leaves negative inputs "
        "undefined)",
        "paraphrase",
    ),
    "fnuz": Spec(
        "no standard (fnuz formats are vendor conventions, described by ml_dtypes/LLVM)",
        "finite, no negative zero, the single NaN at 0x80; rounding is judged by "
        f"{IEEE} §4.3 as for every binary format",
        "paraphrase",
    ),
}

_ROUNDING_SPEC = {
    "nearest_even": "ieee-4.3.1-even",
    "nearest_away": "ieee-4.3.1-away",
    "up": "ieee-4.3.2-up",
    "down": "ieee-4.3.2-down",
    "toward_zero": "ieee-4.3.2-zero",
    "to_odd": "ieee-5.1",
}


def rounding_spec(mode: str) -> str:
    """Key of the clause that defines a rounding mode."""
    return _ROUNDING_SPEC.get(mode, "ieee-5.1")


def spec_for_format(name: str) -> str:
    """Which document governs a format: IEEE 754 for binary16/32/bfloat16 and the IEEE-like
    fp8 variants, OFP8 for E4M3/E5M2, MX for E8M0/FP6/FP4."""
    if name in ("float8_e4m3fn", "float8_e5m2"):
        return OFP8
    if name in ("float8_e8m0fnu", "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn"):
        return MX
    if name.endswith("fnuz"):
        return SPECS["fnuz"].source
    return IEEE
