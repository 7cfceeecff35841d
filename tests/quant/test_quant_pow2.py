"""Exact power-of-two helpers on float32 bit patterns, against float64 numpy."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from precisionlab.quant import _pow2 as pow2

F32 = np.float32


def _wide_floats(n, seed):
    rng = np.random.default_rng(seed)
    with np.errstate(over="ignore"):
        x = (rng.standard_normal(n) * 10.0 ** rng.integers(-46, 39, n)).astype(F32)
    x = x[np.isfinite(x)]
    return np.concatenate([x, np.array([0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38], F32)])


def test_ldexp_matches_float64_including_subnormals():
    x = _wide_floats(20000, 0)
    k = np.random.default_rng(1).integers(-300, 300, x.size).astype(np.int32)
    got = np.asarray(pow2.ldexp(x, k))
    with np.errstate(over="ignore"):
        want = (x.astype(np.float64) * np.exp2(k.astype(np.float64))).astype(F32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@given(st.floats(width=32, allow_nan=False, allow_infinity=False), st.integers(-300, 300))
def test_ldexp_property(x, k):
    got = np.asarray(pow2.ldexp(np.array([x], F32), np.array([k], np.int32)))
    with np.errstate(over="ignore"):
        want = np.array([np.float64(x) * 2.0**k], np.float64).astype(F32)
    assert got.view(np.uint32)[0] == want.view(np.uint32)[0]


def test_floor_ceil_log2_and_ratio():
    x = _wide_floats(5000, 2)
    x = x[x != 0]
    x64 = np.abs(x.astype(np.float64))
    np.testing.assert_array_equal(pow2.floor_log2(x), np.floor(np.log2(x64)))
    np.testing.assert_array_equal(pow2.ceil_log2(x), np.ceil(np.log2(x64)))
    for c in (448.0, 57344.0, 6.0, 7.5, 28.0, 127.0, 127 / 64):
        np.testing.assert_array_equal(pow2.ceil_log2_ratio(x, c), np.ceil(np.log2(x64 / c)))
    assert int(pow2.floor_log2(np.float32(0))) == pow2.ZERO_LOG2


def test_pow2_values():
    k = np.arange(-151, 129, dtype=np.int32)
    with np.errstate(over="ignore"):
        want = np.exp2(k.astype(np.float64)).astype(F32)
    np.testing.assert_array_equal(np.asarray(pow2.pow2(k)), want)
