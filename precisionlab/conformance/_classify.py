"""Classify a library's disagreements with the exact reference.

Each disagreement gets one rule (the first that applies, in the order of :data:`RULES`); each
rule has a category:

- ``violation``: the spec defines the result and the library returns another;
- ``convention``: the spec allows a choice (saturating fp8 conversion) or names no rule for the
  case (E8M0 ties), and the library chose differently from the reference's convention;
- ``undefined``: the input has no counterpart the spec could name (NaN into FP4/FP6, zero or a
  negative number into E8M0, inf into a format with neither inf nor NaN).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from precisionlab.bits._rounding import Rounding, parse_rounding
from precisionlab.conformance._exact import (
    as_float_format,
    decode_codes,
    encode_exact,
    is_midpoint,
    is_nan_code,
)
from precisionlab.conformance._spec import rounding_spec
from precisionlab.formats import Format

__all__ = ["CATEGORIES", "RULES", "Rule", "classify"]

#: How a disagreement with the exact reference is classified.
CATEGORIES = ("violation", "convention", "undefined")


class Rule(NamedTuple):
    category: str
    title: str
    spec: str  # key of precisionlab.conformance._spec.SPECS; "<mode>" means the mode's clause


#: The specification rules a conversion is judged by, by name.
RULES: dict[str, Rule] = {
    "nan-no-encoding": Rule("undefined", "NaN into a format without NaN", "mx-fp6-fp4"),
    "nan-not-nan": Rule("violation", "NaN did not convert to NaN", "ieee-6.2"),
    "inf-no-encoding": Rule(
        "undefined", "infinity into a format with neither inf nor NaN", "mx-fp6-fp4"
    ),
    "negative-unsigned": Rule("undefined", "negative value into an unsigned format", "mx-e8m0"),
    "zero-no-encoding": Rule("undefined", "zero into a format without zero", "mx-e8m0"),
    "inf-saturated": Rule("convention", "infinity saturated to the largest value", "ocp8-sat"),
    "inf-wrong": Rule("violation", "infinity converted to something else", "ieee-7.4"),
    "overflow-saturated-fp8": Rule(
        "convention", "overflow saturated to the largest value (saturating mode)", "ocp8-sat"
    ),
    "overflow-saturated": Rule(
        "violation", "overflow saturated where the mode carries it to inf", "ieee-7.4"
    ),
    "e8m0-tie": Rule(
        "convention", "tie between two powers of two (no even digit to choose)", "mx-e8m0"
    ),
    "subnormal-input-as-zero": Rule("violation", "subnormal input treated as zero", "ieee-5.1"),
    "double-rounding": Rule(
        "violation", "rounded to float32 first, then to the format (double rounding)", "ieee-5.1"
    ),
    "near-tie": Rule(
        "violation",
        "input one ulp from a tie rounded as the tie (decided in inexact arithmetic)",
        "<mode>",
    ),
    "nan-for-number": Rule("violation", "a number converted to NaN", "<mode>"),
    "flush-to-zero": Rule(
        "violation", "subnormal (or smallest normal) result flushed to zero", "<mode>"
    ),
    "zero-not-in-format": Rule(
        "violation", "returned zero, which the format cannot hold", "mx-e8m0"
    ),
    "zero-sign": Rule("violation", "zero of the wrong sign", "ieee-4.3-sign"),
    "wrong-tie": Rule("violation", "tie broken the wrong way", "<mode>"),
    "not-a-value": Rule("violation", "returned a value the format does not hold", "<mode>"),
    "misrounded": Rule("violation", "not the correctly rounded value", "<mode>"),
}


def _rounded_as_near_tie(
    x: np.ndarray, lib: np.ndarray, fmt: Format, mode: Rounding, source: str, saturate: bool
) -> np.ndarray:
    """Inputs one ulp (of the source type) from a midpoint that the library rounded as the
    midpoint itself would be rounded."""
    out = np.zeros(x.shape, dtype=bool)
    if source not in ("float32", "float64"):
        return out
    xs = x.astype(source)
    for direction in (np.inf, -np.inf):
        with np.errstate(over="ignore", invalid="ignore"):
            nb = np.nextafter(xs, np.dtype(source).type(direction)).astype(np.float64)
        mid = is_midpoint(nb, fmt)
        out |= mid & (lib == encode_exact(nb, fmt, mode, saturate=saturate))
    return out


def rule_spec(rule: str, mode: str | Rounding) -> str:
    """Spec key of a rule for a rounding mode."""
    key = RULES[rule].spec
    return rounding_spec(parse_rounding(mode).value) if key == "<mode>" else key


def classify(
    x: np.ndarray,
    lib_codes: np.ndarray,
    ref_codes: np.ndarray,
    fmt: Format | str,
    rounding: str | Rounding,
    source: str,
    *,
    saturate: bool = False,
    lib_values: np.ndarray | None = None,
) -> np.ndarray:
    """Rule id (an array of str) for each disagreement.

    Args:
      x: the inputs, as float64 (exact images of the source values).
      lib_codes: the library's codes (int64; -1 where it returned no code of the format).
      ref_codes: the exact reference's codes for the same claim.
      fmt: the target format. rounding/saturate: what the library claims.
      source: the source type's name (``"float64"``, ``"float32"``, ...).
      lib_values: what the library returned as numbers (float64), for libraries that return
        values rather than codes; by default the codes' values.
    """
    fmt = as_float_format(fmt)
    mode = parse_rounding(rounding)
    x = np.asarray(x, dtype=np.float64)
    lib = np.asarray(lib_codes, dtype=np.int64)
    ref = np.asarray(ref_codes, dtype=np.int64)
    out = np.full(x.shape, "misrounded", dtype=object)
    done = np.zeros(x.shape, dtype=bool)

    def assign(mask: np.ndarray, rule: str) -> None:
        nonlocal done
        mask = mask & ~done
        out[mask] = rule
        done = done | mask

    xnan, xinf, xzero = np.isnan(x), np.isinf(x), x == 0
    xneg = np.signbit(x)
    finite = ~(xnan | xinf | xzero)
    lib_nan = is_nan_code(lib, fmt)
    ref_nan = is_nan_code(ref, fmt)
    lib_val = decode_codes(lib, fmt) if lib_values is None else np.asarray(lib_values, float)
    ref_val = decode_codes(ref, fmt)
    sat = encode_exact(x, fmt, mode, saturate=True)

    assign(xnan & (not fmt.has_nan), "nan-no-encoding")
    assign(xnan, "nan-not-nan")
    assign(xinf & (not fmt.has_inf) & (not fmt.has_nan), "inf-no-encoding")
    if not fmt.signed:
        assign(xneg & (~xzero | (not fmt.has_zero)), "negative-unsigned")
    assign(xzero & (not fmt.has_zero), "zero-no-encoding")
    assign(xinf & (not fmt.has_inf) & (lib == sat), "inf-saturated")
    assign(xinf, "inf-wrong")
    tie = is_midpoint(x, fmt)
    if fmt.mantissa_bits == 0:
        assign(tie, "e8m0-tie")
    near_tie = _rounded_as_near_tie(x, lib, fmt, mode, source, saturate) & finite
    if source == "float64" and fmt.mantissa_bits < 23:
        # Checked before saturation: a float32 intermediate can land on the overflow tie.
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            via32 = finite & (
                lib == encode_exact(x.astype(np.float32), fmt, mode, saturate=saturate)
            )
        # Rounding through float32 shows on inputs farther than one ulp from a tie too;
        # without such evidence an input next to a tie is only "rounded as the tie".
        if (via32 & ~near_tie & ~done).any():
            assign(via32, "double-rounding")
    overflow = finite & (sat != ref)  # beyond the range: only saturation changes it
    fp8 = fmt.bits <= 8
    assign(overflow & (lib == sat), "overflow-saturated-fp8" if fp8 else "overflow-saturated")

    a = np.abs(x)
    source_fmt = as_float_format(source)
    src_subnormal = finite & (a < source_fmt.smallest_normal)
    zero_code = encode_exact(np.where(xneg, -0.0, 0.0), fmt, mode, saturate=saturate)
    assign(src_subnormal & (lib == zero_code), "subnormal-input-as-zero")
    assign(finite & lib_nan & ~ref_nan, "nan-for-number")
    # The smallest normal counts: a flush-to-zero unit also zeroes inputs that round up to it.
    subnormal_ref = (ref_val != 0) & (np.abs(ref_val) <= fmt.smallest_normal)
    # Next to the tie at half the smallest subnormal a zero is "rounded as the tie" instead.
    assign(finite & (lib_val == 0) & subnormal_ref & (lib >= 0) & ~near_tie, "flush-to-zero")
    assign(near_tie, "near-tie")
    assign(finite & (lib_val == 0) & (lib < 0), "zero-not-in-format")
    assign(
        (lib_val == 0) & (ref_val == 0) & (np.signbit(lib_val) != np.signbit(ref_val)),
        "zero-sign",
    )
    assign(tie, "wrong-tie")
    assign(lib < 0, "not-a-value")
    if (out == "misrounded").any():
        # Misrounding far from ties too: the inputs next to a tie are no separate pattern.
        out[out == "near-tie"] = "misrounded"
    return out
