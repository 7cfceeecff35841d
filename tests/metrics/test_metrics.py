"""error_report against float64 numpy formulas."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from precisionlab.metrics import ErrorReport, error_report, format_table

F32 = np.float32


def _pair(seed=0, n=5000):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(F32)
    x[:10] = 0.0
    x_hat = (x + rng.standard_normal(n).astype(F32) * F32(0.01)).astype(F32)
    return x, x_hat


def test_matches_float64_formulas():
    x, x_hat = _pair()
    r = error_report(jnp.asarray(x), jnp.asarray(x_hat)).to_dict()
    x64, h64 = x.astype(np.float64), x_hat.astype(np.float64)
    e = h64 - x64
    nz = x64 != 0
    want = {
        "max_abs_error": np.max(np.abs(e)),
        "mean_abs_error": np.mean(np.abs(e)),
        "rmse": np.sqrt(np.mean(e**2)),
        "mean_rel_error": np.mean(np.abs(e[nz]) / np.abs(x64[nz])),
        "max_rel_error": np.max(np.abs(e[nz]) / np.abs(x64[nz])),
        "sqnr_db": 10 * np.log10(np.sum(x64**2) / np.sum(e**2)),
        "bias": np.mean(e),
    }
    for k, v in want.items():
        np.testing.assert_allclose(r[k], v, rtol=2e-4, atol=1e-9, err_msg=k)
    assert r["n"] == 5000 and np.isnan(r["mean_ulp_error"])
    assert r["frac_underflow"] == 0.0 and r["frac_overflow"] == 0.0


def test_ulp_error_of_round_to_nearest_is_at_most_half():
    x = np.random.default_rng(1).uniform(-400, 400, 20000).astype(F32)
    x_hat = x.astype(ml_dtypes.float8_e4m3fn).astype(F32)
    r = error_report(x, x_hat, "e4m3fn")
    assert 0.45 < float(r.max_ulp_error) <= 0.5
    assert 0.2 < float(r.mean_ulp_error) < 0.3


def test_overflow_underflow_saturation_subnormal_fractions():
    x = np.array([1e6, -1e6, 1e-9, 3e-6, 1.0, 2.0, 70000.0, 0.0], F32)
    with np.errstate(over="ignore"):
        x_hat = x.astype(np.float16).astype(F32)  # 1e6 and 70000 overflow to inf, 1e-9 to 0
    r = error_report(x, x_hat, "fp16").to_dict()
    assert r["frac_overflow"] == 3 / 8
    assert r["frac_underflow"] == 1 / 8
    assert r["frac_subnormal"] == 1 / 8  # 3e-6 is a float16 subnormal
    assert np.isfinite(r["max_abs_error"])  # error statistics skip the overflowed pairs
    with np.errstate(over="ignore"):
        sat = np.minimum(x, F32(65504)).astype(np.float16).astype(F32)
    r2 = error_report(x, sat, "fp16").to_dict()
    assert r2["frac_saturated"] == 2 / 8 and r2["frac_overflow"] == 1 / 8  # -1e6 still -inf


def test_mx_floor_rule_saturation_is_counted():
    from precisionlab.quant import dequantize, element_scales, quantize

    x = jnp.asarray(np.r_[7.5, np.ones(31)].astype(F32))  # 7.5 > fp4 max 6 at scale 2**0
    q = quantize(x, "mxfp4")
    assert float(dequantize(q)[0]) == 6.0
    r = error_report(x, dequantize(q), q.fmt, scale=element_scales(q))
    assert float(r.frac_saturated) == 1 / 32
    q = quantize(x, "mxfp4", scale_rule="rceil")  # the rceil rule never saturates
    assert float(error_report(x, dequantize(q), q.fmt, scale=element_scales(q)).frac_saturated) == 0


def test_exact_copy_has_infinite_sqnr_and_zero_errors():
    x, _ = _pair()
    r = error_report(x, x.copy())
    assert float(r.sqnr_db) == np.inf and float(r.max_abs_error) == 0.0


def test_jit_pytree_json_and_table():
    x, x_hat = _pair(2)
    r = jax.jit(lambda a, b: error_report(a, b, "bf16"))(jnp.asarray(x), jnp.asarray(x_hat))
    assert isinstance(r, ErrorReport) and r.fmt == "bf16"
    d = r.to_dict()
    json.loads(json.dumps(d))
    text = str(r)
    assert "SQNR dB" in text and "max ulp" in text
    table = format_table([{"format": "bf16", **d}], ["format", "sqnr_db", "rmse"])
    assert table.splitlines()[0].split() == ["format", "SQNR", "dB", "rmse"]


def test_errors():
    with pytest.raises(ValueError, match="one shape"):
        error_report(np.ones(3, F32), np.ones(4, F32))
    with pytest.raises(TypeError, match="float"):
        error_report(np.ones(3, np.int32), np.ones(3, np.int32))
    with pytest.raises(ValueError, match="unknown format"):
        error_report(np.ones(3, F32), np.ones(3, F32), "fp7")


@pytest.mark.parametrize("magnitude", [1.0, 1e20, 1e-18, 1e-38])
def test_statistics_hold_at_every_magnitude(magnitude):
    """Squares and differences of huge or subnormal tensors must neither overflow nor flush
    (float32 sums of x**2 overflow above ~1e19; XLA on CPU flushes subnormals)."""
    from precisionlab.bits import round_to_format

    x = (np.random.default_rng(0).normal(size=4096) * magnitude).astype(np.float32)
    x_hat = np.asarray(round_to_format(x, "bf16"))
    r = error_report(x, x_hat, "bf16")
    e = x_hat.astype(np.float64) - x.astype(np.float64)
    ref_sqnr = 10 * np.log10((x.astype(np.float64) ** 2).sum() / (e**2).sum())
    assert float(r.sqnr_db) == pytest.approx(ref_sqnr, abs=1e-3)
    assert float(r.rmse) == pytest.approx(np.sqrt((e**2).mean()), rel=1e-5)
    assert float(r.max_abs_error) == np.abs(e).max()


def test_subnormal_inputs_that_vanish_count_as_underflow():
    x = np.full(8, 1e-40, np.float32)
    r = error_report(x, np.zeros(8, np.float32))
    assert float(r.frac_underflow) == 1.0 and float(r.sqnr_db) == 0.0
    assert float(r.max_abs_error) == float(np.float32(1e-40))


def test_mx_format_names_are_accepted():
    import jax.numpy as jnp

    from precisionlab.quant import dequantize, element_scales, quantize

    x = jnp.linspace(-3, 3, 64, dtype=jnp.float32)
    q = quantize(x, "mxfp4")
    r = error_report(x, dequantize(q), "mxfp4", scale=element_scales(q))
    assert np.isfinite(float(r.mean_ulp_error))
