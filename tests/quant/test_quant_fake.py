"""fake_quant: equals dequantize(quantize(.)) and has exactly the straight-through gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from precisionlab.quant import dequantize, fake_quant, quantize

F32 = np.float32


def _x(shape=(8, 64), seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(F32)


CASES = [
    pytest.param("int8", {}, id="int8-tensor"),
    pytest.param("int8", {"scale": "percentile:90"}, id="int8-p90"),
    pytest.param("int4", {"block_size": 32, "scale": "percentile:80"}, id="int4-block-p80"),
    pytest.param("uint8", {"axis": 0, "scale": "percentile:95"}, id="uint8-asym-p95"),
    pytest.param("e4m3fn", {"scale": "percentile:90"}, id="e4m3fn-p90"),
    pytest.param("mxfp8_e4m3", {}, id="mxfp8-floor"),
]


@pytest.mark.parametrize("fmt,kw", CASES)
def test_forward_equals_dequantize_quantize(fmt, kw):
    x = jnp.asarray(_x())
    np.testing.assert_array_equal(fake_quant(x, fmt, **kw), dequantize(quantize(x, fmt, **kw)))


def _ref_mask(x, q):
    """float64 STE reference: inside iff the scaled value is within half a step of the
    extreme codes (so it rounds to a code instead of being clipped)."""
    from precisionlab.quant import element_scales

    s = np.asarray(element_scales(q), np.float64)
    y = x.astype(np.float64) / s
    fmt = q.element_format
    if q.zero_points is not None:
        from precisionlab.bits import decode

        zp = np.asarray(decode(q.zero_points, fmt), np.float64)
        zp = np.broadcast_to(zp[:, None], x.shape) if q.axis == 0 else zp
        return (y + zp >= fmt.min - 0.5) & (y + zp <= fmt.max + 0.5)
    if hasattr(fmt, "mantissa_bits"):
        top = fmt.max + 2.0 ** (fmt.emax - fmt.mantissa_bits - 1)
        return np.abs(y) <= top
    return np.abs(y) <= fmt.max + 0.5


@pytest.mark.parametrize("fmt,kw", CASES)
def test_gradient_is_exactly_the_ste_rule(fmt, kw):
    x = _x(seed=3)
    x[0, 0] = 40.0  # an outlier: clipped under percentile scales, saturates MX floor
    w = np.random.default_rng(1).standard_normal(x.shape).astype(F32)
    g = jax.grad(lambda x: jnp.sum(fake_quant(x, fmt, **kw) * w))(jnp.asarray(x))
    mask = _ref_mask(x, quantize(jnp.asarray(x), fmt, **kw))
    if fmt == "int8" and not kw:
        assert mask.all()  # amax scaling clips nothing
    if "percentile" in kw.get("scale", ""):
        assert 0 < mask.mean() < 1 and not mask[0, 0]
    np.testing.assert_array_equal(np.asarray(g), np.where(mask, w, 0).astype(F32))


def test_amax_element_gets_gradient_one_unlike_clip():
    x = jnp.asarray(np.array([0.1, -0.5, 2.0, -3.0], F32))
    g = jax.grad(lambda x: jnp.sum(fake_quant(x, "int8")))(x)
    np.testing.assert_array_equal(g, [1, 1, 1, 1])  # -3.0 is the amax element


def test_identity_ste_and_jit_vmap():
    x = jnp.asarray(_x(seed=5))
    x = x.at[0, 0].set(100.0)
    g = jax.grad(lambda x: jnp.sum(fake_quant(x, "int4", scale="percentile:50", ste="identity")))(x)
    np.testing.assert_array_equal(g, np.ones(x.shape, F32))
    f = jax.jit(lambda x: fake_quant(x, "mxfp4"))
    np.testing.assert_array_equal(f(x), fake_quant(x, "mxfp4"))
    v = jax.vmap(lambda r: fake_quant(r, "int8"))(x)
    np.testing.assert_array_equal(v, jnp.stack([fake_quant(r, "int8") for r in x]))
    gv = jax.vmap(jax.grad(lambda r: jnp.sum(fake_quant(r, "int8", scale="percentile:50"))))(x)
    assert gv.shape == x.shape and 0 < float(gv.mean()) < 1


def test_dtype_preserved_and_errors():
    x = jnp.asarray(_x()).astype(jnp.bfloat16)
    assert fake_quant(x, "int8").dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="unknown ste 'none'"):
        fake_quant(x, "int8", ste="none")
    with pytest.raises(ValueError, match="PRNG key"):
        fake_quant(x, "int8", rounding="stochastic")
