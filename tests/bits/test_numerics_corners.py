"""Numerics corners of issue 10, each against an independent float64 / exact reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from precisionlab.quant import dequantize, fake_quant, quantize


# --- MXINT8 and -2.0 ---------------------------------------------------------------------------
def _mxint8_reference(t: np.ndarray, qmin: int) -> np.ndarray:
    """A block whose amax is 1 has X = 2**floor(log2 1) = 1; elements are int8 codes read
    with 6 fraction bits, rounded to nearest even and clipped to [qmin, 127]."""
    return np.clip(np.rint(t.astype(np.float64) * 64), qmin, 127) / 64


@pytest.mark.parametrize(("full_range", "qmin"), [(False, -127), (True, -128)])
def test_mxint8_grid_against_reference(full_range, qmin):
    # Every quarter step of the code grid in [-2, 1.99]: ties, codes and the -2 corner.
    t = np.arange(-2 * 256, 2 * 256) / 256
    t = t[np.abs(t) <= 1.0 + 63 / 64 + 1 / 128]
    n = len(t) // 31 * 31
    blocks = np.concatenate([np.ones((n // 31, 1)), t[:n].reshape(-1, 31)], axis=1)
    got = np.asarray(dequantize(quantize(jnp.asarray(blocks, jnp.float32), "mxint8",
                                         full_range=full_range)))  # fmt: skip
    np.testing.assert_array_equal(got, _mxint8_reference(blocks, qmin))


def test_mxint8_minus_two_only_with_full_range():
    x = jnp.array([1.0, -1.99609375, -1.9921875] + [0.5] * 29, jnp.float32)  # X = 1
    default = dequantize(quantize(x, "mxint8"))
    full = dequantize(quantize(x, "mxint8", full_range=True))
    assert float(default[1]) == -1.984375  # the reference implementation's symmetric clamp
    assert abs(float(default[1]) - -1.99609375) == pytest.approx(0.01171875)
    assert float(default[2]) == -1.984375
    assert float(full[1]) == -2.0  # the nearest code, 0x80
    assert float(full[2]) == -2.0  # -127.5 in code units: a tie, to even -128
    assert abs(float(full[1]) - -1.99609375) == 0.00390625
    with pytest.raises(ValueError, match="full_range applies to MXINT8"):
        quantize(x, "mxfp8_e4m3", full_range=True)


# --- tiny amax ---------------------------------------------------------------------------------
@pytest.mark.parametrize("amax", [1e-36, 1e-37, 3e-38, 1.5e-38, 1e-30])
def test_tiny_amax_is_not_flushed_to_zero(amax):
    rng = np.random.default_rng(0)
    x = (rng.uniform(-1, 1, 64) * amax).astype(np.float32)
    x[0] = np.float32(amax)
    x = x[np.abs(x) >= np.finfo(np.float32).tiny]  # normal inputs (CPU flushes subnormals)
    got = np.asarray(dequantize(quantize(jnp.asarray(x), "int8")))
    # float64 reference of the documented rule: s = max(amax * (1/127), 2**-126).
    s = max(float(np.float32(np.max(np.abs(x))) * np.float32(1 / np.float32(127))), 2.0**-126)
    s = np.float32(s) if s >= 2.0**-126 else np.float32(2.0**-126)
    q = np.clip(np.rint(x.astype(np.float64) * np.float64(np.float32(1) / s)), -127, 127)
    np.testing.assert_array_equal(got, (q * np.float64(s)).astype(np.float32))
    assert np.count_nonzero(got) > len(x) // 2


# --- NaN: one rule for every scale method --------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [{"scale": "amax"}, {"scale": "mse"}, {"scale": "percentile:99"}, {"scale": "percentile:50"},
     {"scale": "percentile:99", "scheme": "asymmetric"}, {"scale": "amax", "block_size": 4}],
)  # fmt: skip
def test_a_nan_makes_its_group_nan_for_every_scale_method(kwargs):
    x = jnp.array([[1.0, jnp.nan, 0.5, 0.25], [1.0, -0.5, 0.75, 0.125]], jnp.float32)
    got = np.asarray(dequantize(quantize(x, "int8", axis=None if "block_size" in kwargs else 0,
                                         **kwargs)))  # fmt: skip
    assert np.isnan(got[0]).all()
    assert np.isfinite(got[1]).all()


def test_mx_nan_rule_matches():
    x = jnp.array([1.0, jnp.nan] + [0.5] * 30, jnp.float32)
    assert np.isnan(np.asarray(dequantize(quantize(x, "mxfp8_e4m3")))).all()


# --- fake_quant's straight-through mask at an exact tie -------------------------------------
def test_ste_tie_at_qmax_plus_half_gets_no_gradient():
    v = jnp.array([127.5, -127.5, 126.5, -128.5, 127.4999], jnp.float32)
    grad = jax.grad(lambda v: fake_quant(v, "int8", scale="none").sum())
    # nearest-even: 127.5 -> 128 and -127.5 -> -128 are clipped; 126.5 -> 126 is inside.
    np.testing.assert_array_equal(np.asarray(grad(v)), [0, 0, 1, 0, 1])
    grad_full = jax.grad(lambda v: fake_quant(v, "int8", scale="none", full_range=True).sum())
    # with -128 a code, -127.5 and -128.5 round to -128 (even): inside.
    np.testing.assert_array_equal(np.asarray(grad_full(v)), [0, 1, 1, 1, 1])


def test_ste_float_tie_follows_round_to_even():
    e4m3 = jax.grad(lambda v: fake_quant(v, "e4m3fn", scale="none").sum())
    e5m2 = jax.grad(lambda v: fake_quant(v, "e5m2", scale="none").sum())
    # 464 = 448 + half an ulp rounds to 448 (even mantissa 110); 61440 = 57344 + half an ulp
    # rounds to inf in E5M2 (57344's mantissa 11 is odd).
    assert fake_quant(jnp.array([464.0]), "e4m3fn", scale="none")[0] == 448
    np.testing.assert_array_equal(np.asarray(e4m3(jnp.array([464.0, -464.0]))), [1, 1])
    np.testing.assert_array_equal(np.asarray(e5m2(jnp.array([61440.0, 61439.0]))), [0, 1])
