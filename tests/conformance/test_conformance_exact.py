"""The vectorized exact reference of ``precisionlab conformance`` against two independent
oracles: the scalar reference in Python fractions (``bits.reference.encode_scalar``) and a
brute-force search over the enumerated values of each small format."""

import itertools

import ml_dtypes
import numpy as np
import pytest

from precisionlab.bits._rounding import Rounding
from precisionlab.bits.reference import encode_scalar
from precisionlab.conformance._cases import KNOWN, edge_inputs, extreme_inputs
from precisionlab.conformance._exact import (
    MODES,
    decode_codes,
    encode_exact,
    is_midpoint,
    values_to_codes,
)
from precisionlab.formats import FORMATS, FloatFormat

FLOATS = [f for f in FORMATS.values() if isinstance(f, FloatFormat) and f.bits < 64]
NARROW = [f for f in FLOATS if f.bits <= 8]


def _every_16bit_value() -> np.ndarray:
    codes = np.arange(1 << 16, dtype=np.uint16)
    with np.errstate(invalid="ignore"):
        f16 = codes.view(np.float16).astype(np.float64)
        bf16 = codes.view(ml_dtypes.bfloat16).astype(np.float64)
    return np.concatenate([f16, bf16])


def _same_codes(a, b, fmt) -> np.ndarray:
    """Equal codes, any NaN code equal to any other."""
    nan = np.isnan(decode_codes(a, fmt)) & np.isnan(decode_codes(b, fmt))
    return (np.asarray(a) == np.asarray(b)) | nan


def _scalar(xs, fmt, mode, saturate=False) -> np.ndarray:
    return np.array(
        [encode_scalar(float(v), fmt, rounding=mode, saturate=saturate) for v in xs],
        dtype=np.int64,
    )


@pytest.mark.parametrize("fmt", FLOATS, ids=lambda f: f.name)
def test_matches_scalar_reference_on_random_and_edge_inputs(fmt):
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2**64, 60, dtype=np.uint64).view(np.float64)
    scaled = np.ldexp(rng.standard_normal(60), rng.integers(-150, 140, 60))
    ends = extreme_inputs(fmt, "float64").astype(np.float64)
    xs = np.concatenate([bits, scaled, ends, KNOWN, -KNOWN])
    for mode in MODES:
        for saturate in (False, True):
            got = encode_exact(xs, fmt, mode, saturate=saturate)
            want = _scalar(xs, fmt, mode, saturate)
            bad = ~_same_codes(got, want, fmt)
            assert not bad.any(), (mode, saturate, xs[bad][:3], got[bad][:3], want[bad][:3])


def _enumeration_oracle(xs: np.ndarray, fmt: FloatFormat, mode: Rounding) -> np.ndarray:
    """Codes by brute force: the two enumerated neighbours of each finite in-range x, chosen
    by an exact comparison with their midpoint (exact in float64 for these formats)."""
    codes = np.arange(1 << fmt.bits)
    values = decode_codes(codes, fmt)
    finite = np.isfinite(values)
    values, codes = values[finite], codes[finite]
    order = np.lexsort((codes, values))  # -0 and +0 tie: keep both, sorted by code
    values, codes = values[order], codes[order]
    hi_i = np.searchsorted(values, xs, side="left")
    lo_i = np.searchsorted(values, xs, side="right") - 1
    lo_v, hi_v = values[lo_i], values[hi_i]
    lo_c, hi_c = codes[lo_i], codes[hi_i]
    exact = lo_v == xs
    mid = (lo_v + hi_v) / 2
    neg = xs < 0
    if mode is Rounding.NEAREST_EVEN:
        up = (xs > mid) | ((xs == mid) & (lo_c & 1 == 1) & (fmt.mantissa_bits > 0))
    elif mode is Rounding.NEAREST_AWAY:
        up = (xs > mid) | ((xs == mid) & ~neg)
    elif mode is Rounding.TOWARD_ZERO:
        up = neg
    elif mode is Rounding.UP:
        up = np.ones_like(neg)
    else:
        up = np.zeros_like(neg)
    out = np.where(exact, lo_c, np.where(up, hi_c, lo_c))
    # A result of zero keeps the input's sign where the format has -0.
    neg_zero = fmt.sign_mask if fmt.has_negative_zero else 0
    return np.where(decode_codes(out, fmt) == 0, np.where(neg, neg_zero, 0), out)


@pytest.mark.parametrize("fmt", [f for f in NARROW if f.signed], ids=lambda f: f.name)
@pytest.mark.parametrize(
    "mode",
    [Rounding.NEAREST_EVEN, Rounding.NEAREST_AWAY, Rounding.TOWARD_ZERO, Rounding.UP,
     Rounding.DOWN],
    ids=str,
)  # fmt: skip
def test_matches_enumeration_on_every_16bit_value_in_range(fmt, mode):
    """Every float16 and bfloat16 value strictly inside the format's range (nonzero), plus
    the float64 neighbours of every midpoint: exhaustive where it is cheap."""
    xs = _every_16bit_value()
    values = np.unique(decode_codes(np.arange(1 << fmt.bits), fmt))
    values = values[np.isfinite(values)]
    mids = (values[:-1] + values[1:]) / 2
    xs = np.concatenate([xs, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf)])
    inside = np.isfinite(xs) & (np.abs(xs) < fmt.max) & (xs != 0)
    xs = xs[inside]
    got = encode_exact(xs, fmt, mode)
    want = _enumeration_oracle(xs, fmt, mode)
    same = got == want
    assert same.all(), (xs[~same][:3], got[~same][:3], want[~same][:3])


def test_e8m0_matches_enumeration_on_every_16bit_value():
    fmt = FORMATS["float8_e8m0fnu"]
    xs = _every_16bit_value()
    xs = xs[np.isfinite(xs) & (xs >= fmt.smallest_positive) & (xs < fmt.max)]
    for mode in (Rounding.TOWARD_ZERO, Rounding.UP, Rounding.NEAREST_AWAY):
        assert np.array_equal(encode_exact(xs, fmt, mode), _enumeration_oracle(xs, fmt, mode))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", NARROW, ids=lambda f: f.name)
def test_matches_scalar_reference_on_every_16bit_value(fmt):
    xs = _every_16bit_value()
    got = encode_exact(xs, fmt, "nearest_even")
    assert _same_codes(got, _scalar(xs, fmt, "nearest_even"), fmt).all()


def test_is_midpoint_matches_fractions():
    from fractions import Fraction

    fmt = FORMATS["float8_e4m3fn"]
    values = sorted({Fraction(v) for _, v in fmt.finite_values()})
    mids = [float((a + b) / 2) for a, b in itertools.pairwise(values)]
    xs = np.array(mids + [float(v) for v in values] + [mids[5] * (1 + 2**-40)])
    got = is_midpoint(xs, fmt)
    assert got[: len(mids)].all() and not got[len(mids) :].any()
    top = fmt.max + 2.0 ** (fmt.emax - fmt.mantissa_bits) / 2  # the overflow tie counts
    assert is_midpoint([top], fmt)[0]
    assert not is_midpoint([2.0**-128], FORMATS["float8_e8m0fnu"])[0]  # below the smallest


def test_values_to_codes_rejects_values_the_format_lacks():
    fmt = FORMATS["float4_e2m1fn"]
    codes = values_to_codes([0.5, -6.0, np.nan, 0.25, np.inf, -0.0], fmt)
    assert codes.tolist() == [1, 15, -1, -1, -1, 8]
    assert values_to_codes([-0.0], FORMATS["float8_e4m3fnuz"]).tolist() == [0]


@pytest.mark.parametrize("source", ["float64", "float32", "bfloat16"])
def test_edge_inputs_are_exact_unique_and_cover_the_ends(source):
    fmt = FORMATS["float8_e4m3fn"]
    xs = edge_inputs(fmt, source)
    assert xs.dtype == np.dtype(ml_dtypes.bfloat16 if source == "bfloat16" else source)
    bits = xs.view({8: np.uint64, 4: np.uint32, 2: np.uint16}[xs.dtype.itemsize])
    assert len(np.unique(bits)) == len(bits)
    with np.errstate(invalid="ignore"):
        x64 = xs.astype(np.float64)
    for v in (0.0, np.inf, -np.inf, fmt.max, 464.0, fmt.smallest_positive / 2):
        assert v in x64
    assert np.isnan(x64).any() and np.signbit(x64[x64 == 0]).any()
    if source == "float64":
        assert np.nextafter(464.0, 0) in x64 and KNOWN[0] in x64
