"""Scalar reference of one tensor-core step, with Python integers and fractions.

Slow and obviously exact: the check for the vectorized int32 kernel (as :mod:`precisionlab.bits`
keeps a scalar reference beside each codec). Values are Python floats exactly representable
in their formats; the result is the float32 value as a Python float.
"""

from __future__ import annotations

import math
from fractions import Fraction

from precisionlab.formats import FloatFormat, get_format
from precisionlab.hardware._step import Step

__all__ = ["EMIN", "SCALE_EMIN", "block_step_reference", "chain_reference", "step_reference"]


def _emin(name: str) -> int:
    f = get_format(name)
    assert isinstance(f, FloatFormat)  # _NAMES are float formats
    return f.emin


#: smallest normal exponent of each input format (from :mod:`precisionlab.formats`)
_NAMES = ("float8_e4m3fn", "float8_e5m2", "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn",
          "float16", "bfloat16")  # fmt: skip
EMIN = {n: _emin(n) for n in _NAMES}


def _exp(x: float, emin: int) -> int:
    return max(math.frexp(x)[1] - 1, emin)


def _rn_f32(v: Fraction) -> float:
    """``v`` rounded to nearest even float32 (inf beyond the range)."""
    if v == 0:
        return 0.0
    sign = -1 if v < 0 else 1
    v = abs(v)
    e = max(math.floor(math.log2(v)) - 1, -200)
    while Fraction(2) ** (e + 1) <= v:
        e += 1
    while Fraction(2) ** e > v:
        e -= 1
    q = max(e - 23, -149)
    n = v / Fraction(2) ** q
    fl = math.floor(n)
    r = n - fl
    if r > Fraction(1, 2) or (r == Fraction(1, 2) and fl % 2 == 1):
        fl += 1
    out = fl * Fraction(2) ** q
    return sign * (math.inf if out >= Fraction(2) ** 128 else float(out))


def step_reference(
    a: list[float], b: list[float], c: float, step: Step, a_format: str, b_format: str,
    scale_exps: list[int] | None = None,
) -> float:  # fmt: skip
    """One step: ``c`` (float32 value) plus the products ``a[i] * b[i]`` as ``step`` computes.

    The scalar reference of :func:`gemm`, written apart from it in exact arithmetic
    (``Fraction``, Python integers): ``a`` and ``b`` hold ``step.products`` values of the
    formats named ``a_format`` and ``b_format`` (``"float8_e4m3fn"``, ...); the result is the
    float32 value the step writes, as a Python float. ``scale_exps[i]`` (MXFP8's block scales):
    product i is multiplied by ``2**scale_exps[i]`` and its alignment exponent raised by as
    much."""
    terms, exps = [], []
    shifts = scale_exps if scale_exps is not None else [0] * len(a)
    for x, y, t in zip(a, b, shifts, strict=True):
        if step.subnormal_inputs == "flush":
            x = 0.0 if abs(x) < 2.0 ** EMIN[a_format] else x
            y = 0.0 if abs(y) < 2.0 ** EMIN[b_format] else y
        if x == 0 or y == 0:
            continue
        terms.append(Fraction(x) * Fraction(y) * Fraction(2) ** t)
        exps.append(_exp(x, EMIN[a_format]) + _exp(y, EMIN[b_format]) + t)
    join = step.accumulator_in_alignment and c != 0
    if join:
        terms.append(Fraction(c))
        exps.append(_exp(c, -126))
    if not terms:
        return c if not step.accumulator_in_alignment else 0.0 * c + 0.0
    big = max(exps)
    unit = Fraction(2) ** (big - step.fraction_bits)
    total = sum(math.trunc(t / unit) for t in terms)  # each addend cut toward zero
    if total == 0:
        s = 0.0
    else:
        drop = max(abs(total).bit_length() - step.result_bits, 0)
        drop = max(drop, -149 - (big - step.fraction_bits))
        mag = abs(total) >> drop
        v = Fraction(mag) * unit * Fraction(2) ** drop
        s = math.copysign(math.inf if v >= Fraction(2) ** 128 else float(v), total)
    if step.accumulator_in_alignment:
        return s
    return _rn_f32(Fraction(c) + Fraction(s))


def chain_reference(
    a: list[float], b: list[float], c: float, step: Step, a_format: str, b_format: str,
    scale_exps: list[int] | None = None,
) -> float:  # fmt: skip
    """One output of a chain: ``c`` then :func:`step_reference` over consecutive groups of
    ``step.products`` pairs of ``a``/``b`` (K values each, K a multiple), each step's result
    the next one's accumulator. ``scale_exps``: K per-product exponent shifts, or None."""
    w = step.products
    if len(a) % w or len(a) != len(b):
        raise ValueError(f"chain_reference needs len(a) == len(b), a multiple of {w}")
    for s in range(0, len(a), w):
        t = None if scale_exps is None else list(scale_exps[s : s + w])
        c = step_reference(list(a[s : s + w]), list(b[s : s + w]), c, step, a_format, b_format, t)
    return c


#: smallest exponent of each block-scale format (E8M0 down to 2**-127; UE4M3's subnormals)
SCALE_EMIN = {"float8_e8m0fnu": -127, "float8_e4m3fn": -6}


def block_step_reference(
    a: list[float], b: list[float], c: float, scales_a: list[float], scales_b: list[float],
    step: Step, scale_format: str,
) -> float:  # fmt: skip
    """One block-scaled step (``step.exact_group > 1``): ``c`` plus the ``products`` pairs,
    group ``g`` (``exact_group`` consecutive pairs) scaled by ``scales_a[g] * scales_b[g]``.

    Each group's products are summed exactly; its addend is that sum times the two scales'
    significands, aligned by the sum of the scales' exponents (zero sums included, zero
    scales not); ``c`` joins with its own exponent unless it is zero. Cut, sum and result as in
    :func:`step_reference` (UE4M3 scales: the sign is ignored)."""
    g = step.exact_group
    emin = SCALE_EMIN[scale_format]
    terms, exps = [], []
    for i in range(len(a) // g):
        s = sum(
            Fraction(x) * Fraction(y)
            for x, y in zip(a[i * g : (i + 1) * g], b[i * g : (i + 1) * g], strict=True)
        )
        sa, sb = abs(scales_a[i]), abs(scales_b[i])
        if sa == 0 or sb == 0:  # a zero scale takes its group out (MMA-Sim: exponent -999)
            continue
        ea, eb = _exp(sa, emin), _exp(sb, emin)
        # value s * sa * sb; the significands are sa / 2**ea and sb / 2**eb
        terms.append(s * Fraction(sa) * Fraction(sb))
        exps.append(ea + eb)
    if c != 0 and step.accumulator_in_alignment:
        terms.append(Fraction(c))
        exps.append(_exp(c, -126))
    big = max(exps, default=0)
    unit = Fraction(2) ** (big - step.fraction_bits)
    total = sum(math.trunc(t / unit) for t in terms)
    if total == 0:
        r = 0.0
    else:
        drop = max(abs(total).bit_length() - step.result_bits, 0)
        drop = max(drop, -149 - (big - step.fraction_bits))
        v = Fraction(abs(total) >> drop) * unit * Fraction(2) ** drop
        r = math.copysign(math.inf if v >= Fraction(2) ** 128 else float(v), total)
    if step.accumulator_in_alignment:
        return r
    return _rn_f32(Fraction(c) + Fraction(r))
