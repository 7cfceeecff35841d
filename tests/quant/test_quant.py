"""quantize / dequantize against float64 numpy references of the same rules."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from precisionlab.formats import IntFormat, get_format
from precisionlab.quant import MX_FORMATS, QArray, dequantize, quantize

F32 = np.float32


def _normal(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(F32)


def _group_view(x, axis, block):
    """numpy grouped view: (groups..., n) with NaN padding, and a function back."""
    if block is None and axis is None:
        return x.reshape(1, -1), lambda v: v.reshape(x.shape)
    if block is None:
        xm = np.moveaxis(x, axis, 0)
        return xm.reshape(xm.shape[0], -1), lambda v: np.moveaxis(v.reshape(xm.shape), 0, axis)
    xm = np.moveaxis(x, axis, -1)
    n = xm.shape[-1]
    nb = -(-n // block)
    pad = np.full((*xm.shape[:-1], nb * block - n), np.nan, x.dtype)
    xb = np.concatenate([xm, pad], axis=-1).reshape(-1, block)

    def back(v):
        v = v.reshape((*xm.shape[:-1], nb * block))[..., :n]
        return np.moveaxis(v, -1, axis)

    return xb, back


def ref_symmetric_int(x, bits, axis=None, block=None):
    """Symmetric narrow-range rule in float32 steps: s = amax * (1/qmax), y = x * (1/s),
    q = clip(rint(y)) in float64, x_hat = q * s rounded once to float32."""
    qmax = 2 ** (bits - 1) - 1
    g, back = _group_view(x, axis, block)
    amax = np.nanmax(np.abs(g), axis=1, keepdims=True).astype(F32)
    s = (amax * (F32(1) / F32(qmax))).astype(F32)
    s = np.where(s > 0, s, F32(1))
    y = (g * (F32(1) / s)).astype(F32)
    q = np.clip(np.rint(y.astype(np.float64)), -qmax, qmax)
    return back((q * s.astype(np.float64)).astype(F32))


def ref_asymmetric_uint(x, bits, axis=None, block=None):
    qmax = 2**bits - 1
    g, back = _group_view(x, axis, block)
    lo = np.minimum(np.nanmin(g, axis=1, keepdims=True), 0).astype(F32)
    hi = np.maximum(np.nanmax(g, axis=1, keepdims=True), 0).astype(F32)
    s = ((hi - lo).astype(F32) * (F32(1) / F32(qmax))).astype(F32)
    s = np.where(s > 0, s, F32(1))
    inv = (F32(1) / s).astype(F32)
    zp = np.clip(np.rint(-(lo * inv).astype(F32).astype(np.float64)), 0, qmax)
    q = np.clip(np.rint((g * inv).astype(F32).astype(np.float64)) + zp, 0, qmax)
    return back(((q - zp) * s.astype(np.float64)).astype(F32))


GRANULARITIES = [
    pytest.param({}, id="tensor"),
    pytest.param({"axis": 0}, id="channel0"),
    pytest.param({"axis": 1}, id="channel1"),
    pytest.param({"block_size": 32}, id="block32"),
    pytest.param({"block_size": 128}, id="block128-ragged"),
    pytest.param({"block_size": 16, "axis": 0}, id="block16-axis0-ragged"),
]


@pytest.mark.parametrize("gran", GRANULARITIES)
@pytest.mark.parametrize("fmt,bits", [("int8", 8), ("int4", 4)])
def test_symmetric_int_matches_float64_reference(fmt, bits, gran):
    x = _normal((24, 200), seed=bits)
    x[3, 7] = 0.0
    x[:, 5] = 0.0  # a zero column: channel 5 of axis 1 has amax 0
    got = np.asarray(dequantize(quantize(jnp.asarray(x), fmt, **gran)))
    axis = gran.get("axis", 1 if "block_size" in gran else None)
    want = ref_symmetric_int(x, bits, axis, gran.get("block_size"))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("gran", GRANULARITIES[:4])
@pytest.mark.parametrize("fmt,bits", [("uint8", 8), ("uint4", 4)])
def test_asymmetric_uint_matches_float64_reference(fmt, bits, gran):
    x = _normal((16, 96), seed=3) + F32(0.7)
    got = np.asarray(dequantize(quantize(jnp.asarray(x), fmt, **gran)))
    axis = gran.get("axis", 1 if "block_size" in gran else None)
    want = ref_asymmetric_uint(x, bits, axis, gran.get("block_size"))
    np.testing.assert_array_equal(got, want)


def test_int_codes_are_twos_complement_in_range():
    x = jnp.asarray(_normal((8, 64)))
    q = quantize(x, "int8", pack_codes=False)
    ints = np.asarray(q.codes).astype(np.int8).astype(int)
    assert ints.min() >= -127 and ints.max() <= 127 and 127 in np.abs(ints)
    q4 = quantize(x, "int4", pack_codes=False)
    c = np.asarray(q4.codes)
    vals = np.where(c >= 8, c.astype(int) - 16, c)
    assert vals.min() >= -7 and vals.max() <= 7


def test_full_range_uses_the_most_negative_code():
    x = jnp.asarray(np.array([-1.0, 0.5, 127 / 128], F32))
    q = quantize(x, "int8", full_range=True, scale="percentile:50", pack_codes=False)
    assert np.asarray(q.codes).astype(np.int8).min() == -128
    q = quantize(x, "int8", scale="percentile:50")
    assert np.asarray(q.codes).astype(np.int8).min() == -127


# --- MX --------------------------------------------------------------------------------
_ML = {
    "mxfp8_e4m3": ml_dtypes.float8_e4m3fn,
    "mxfp8_e5m2": ml_dtypes.float8_e5m2,
    "mxfp6_e2m3": ml_dtypes.float6_e2m3fn,
    "mxfp6_e3m2": ml_dtypes.float6_e3m2fn,
    "mxfp4": ml_dtypes.float4_e2m1fn,
}
# emax_elem and element max (OCP MX v1.0, table 1 / section 5.3)
_SPEC = {
    "mxfp8_e4m3": (8, 448.0),
    "mxfp8_e5m2": (15, 57344.0),
    "mxfp6_e2m3": (2, 7.5),
    "mxfp6_e3m2": (4, 28.0),
    "mxfp4": (2, 6.0),
    "mxint8": (0, 127 / 64),
}


_MBITS = {"mxfp8_e4m3": 3, "mxfp8_e5m2": 2, "mxfp6_e2m3": 3, "mxfp6_e3m2": 2, "mxfp4": 1,
          "mxint8": 6}  # fmt: skip


def _round_mantissa_up_half(a, m):
    """float64 amax (a float32 value) rounded as torchao EVEN does, via frexp: add half a
    unit of the m-th fraction bit, keep only the power of two. float32 subnormals that do
    not carry into the normal range have no exponent bits: they become 0."""
    mant, exp = np.frexp(a)  # a = mant * 2**exp, mant in [0.5, 1)
    up = mant * 2 + 2.0 ** (-m - 1) >= 2  # the added half-unit carries into the exponent
    p = np.ldexp(1.0, exp - 1 + up.astype(int))
    tiny = a < 2.0**-126  # float32 subnormal: exponent field 0
    return np.where(a == 0, 0.0, np.where(tiny & (p < 2.0**-126), 0.0, p))


def ref_mx(x, name, rule="floor"):
    """float64 reference of OCP MX v1.0 section 6.3 on blocks of 32 along the last axis,
    elements rounded by ml_dtypes casts (MXINT8: rint to multiples of 2**-6)."""
    emax, elem_max = _SPEC[name]
    g, back = _group_view(x, x.ndim - 1, 32)
    g = np.nan_to_num(g.astype(np.float64), nan=0.0)
    amax = np.max(np.abs(g), axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        if rule == "floor":
            e = np.floor(np.log2(amax)) - emax
        elif rule == "ceil":  # torchao CEIL
            e = np.ceil(np.log2(amax)) - emax
        elif rule == "even":  # torchao EVEN: amax to the element's mantissa width first
            e = np.floor(np.log2(_round_mantissa_up_half(amax, _MBITS[name]))) - emax
        else:  # rceil: TE / cuBLAS
            e = np.ceil(np.log2(amax / elem_max))
    e = np.clip(np.where(amax == 0, -127, e), -127, 127)
    v = np.clip(g / 2.0**e, -elem_max, elem_max)
    if name == "mxint8":
        elem = np.rint(v * 64) / 64 + 0.0  # int8 has no negative zero
    else:
        elem = v.astype(_ML[name]).astype(np.float64)
    with np.errstate(over="ignore"):  # blocks near float32 max may round up to inf
        return back((elem * 2.0**e).astype(F32))


def _mx_inputs():
    rng = np.random.default_rng(7)
    blocks = rng.standard_normal((40, 32))
    blocks *= 10.0 ** rng.uniform(-30, 30, (40, 1))  # a wide spread of block magnitudes
    blocks[0] = 0.0  # an all-zero block
    blocks[1] = rng.standard_normal(32) * 1e-40  # float32 subnormals only
    blocks[2] = rng.standard_normal(32) * 1e-44  # the smallest subnormals
    blocks[3] = rng.uniform(-1, 1, 32) * 3.4e38  # near float32 max
    blocks[4, :] = 1.0
    blocks[4, 0] = 1000.0  # the worked example
    blocks[5] = np.ldexp(1.0, rng.integers(-140, 127, 32))  # exact powers of two
    blocks[6, ::2] = 0.0  # zeros inside a block
    blocks[7] *= 1e-38  # straddling the normal/subnormal boundary
    x = blocks.reshape(10, 128).astype(F32)
    ragged = rng.standard_normal((6, 45)).astype(F32)  # a ragged last block
    return x, ragged


@pytest.mark.parametrize("rule", ["floor", "ceil", "rceil", "even"])
@pytest.mark.parametrize("name", list(MX_FORMATS))
def test_mx_matches_spec_reference(name, rule):
    wide, ragged = _mx_inputs()
    for x in (wide, ragged) if rule == "floor" else (wide,):
        q = quantize(jnp.asarray(x), name, scale_rule=rule)
        got = np.asarray(dequantize(q))
        want = ref_mx(x, name, rule)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        assert q.scales.dtype == jnp.uint8 and q.scale_rule == rule


def test_mx_worked_example_floor_896_rceil_1024():
    x = jnp.asarray(np.r_[1000.0, np.ones(31)].astype(F32))
    assert float(dequantize(quantize(x, "mxfp8_e4m3"))[0]) == 896.0
    assert float(dequantize(quantize(x, "mxfp8_e4m3", scale_rule="rceil"))[0]) == 1024.0
    q = quantize(x, "mxfp8_e4m3")
    assert q.scale_rule == "floor" and q.describe()["scale_rule"] == "floor"
    # floor: X = 2**(9 - 8) = 2, E8M0 code 128; rceil: X = 4, code 129;
    # ceil: 2**(10 - 8) = 4, code 129; even: 1000 rounds to 1024 at 3 bits, X = 4
    assert int(q.scales[0]) == 128
    for rule in ("rceil", "ceil", "even"):
        assert int(quantize(x, "mxfp8_e4m3", scale_rule=rule).scales[0]) == 129


def test_mx_rules_differ_where_the_anchors_do():
    # E4M3 (3 fraction bits, emax 8). amax 500 = 1.1111010b * 2**8: floor 2**0, ceil 2**1,
    # rceil ceil(log2(500/448)) = 2**1, even: + half a unit of bit 3 carries -> 512 -> 2**1.
    # amax 480 = 1.111b * 2**8: the same except even: no carry -> 2**0.
    for amax, want in ((500.0, (127, 128, 128, 128)), (480.0, (127, 128, 128, 127))):
        x = jnp.asarray(np.r_[amax, np.ones(31)].astype(F32))
        got = tuple(
            int(quantize(x, "mxfp8_e4m3", scale_rule=r).scales[0])
            for r in ("floor", "ceil", "rceil", "even")
        )
        assert got == want, (amax, got)


def test_mx_nonfinite_block_gets_nan_scale():
    x = np.ones((2, 32), F32)
    x[0, 3] = np.inf
    q = quantize(jnp.asarray(x), "mxfp8_e4m3")
    assert int(q.scales[0, 0]) == 0xFF
    out = np.asarray(dequantize(q))
    assert np.all(np.isnan(out[0])) and np.all(out[1] == 1.0)


def test_mx_scale_shape_and_axis():
    x = _normal((64, 8))
    q = quantize(jnp.asarray(x), "mxfp4", axis=0)
    assert q.scales.shape == (2, 8) and q.packed and q.codes.shape == (256,)
    want = ref_mx(np.ascontiguousarray(x.T), "mxfp4").T
    np.testing.assert_array_equal(np.asarray(dequantize(q)), want)


# --- scales and storage ----------------------------------------------------------------
def test_bits_per_element_and_nbytes():
    x = jnp.asarray(_normal((16, 256)))
    q = quantize(x, "int4", block_size=128)
    assert q.bits_per_element == 4.25
    assert quantize(x, "int4", block_size=128, scale_format="float16").bits_per_element == 4.125
    assert quantize(x, "mxfp4").bits_per_element == 4.25
    assert quantize(x, "mxfp8_e4m3").bits_per_element == 8.25
    # packed int4: 4096 codes -> 2048 bytes, plus 32 float32 scales
    assert q.nbytes == 2048 + 32 * 4
    assert quantize(x, "fp16").bits_per_element == 16  # a plain cast: no scale counted


@pytest.mark.parametrize("rule", ["floor", "rceil"])
def test_pow2_scales_for_ints(rule):
    x = _normal((4, 64), seed=11)
    q = quantize(jnp.asarray(x), "int8", axis=0, scale_format="e8m0", scale_rule=rule)
    amax = np.max(np.abs(x.astype(np.float64)), axis=1, keepdims=True)
    if rule == "rceil":
        e = np.ceil(np.log2(amax / 127))
    else:
        e = np.floor(np.log2(amax)) - 6
    np.testing.assert_array_equal(np.asarray(q.scales).astype(int), (e[:, 0] + 127).astype(int))
    q_ref = np.clip(np.rint(x / 2.0**e), -127, 127)
    np.testing.assert_array_equal(np.asarray(dequantize(q)), (q_ref * 2.0**e).astype(F32))


def test_scaled_float_format_matches_reference():
    x = _normal((8, 50), seed=5) * F32(30)
    got = np.asarray(dequantize(quantize(jnp.asarray(x), "e4m3fn", axis=0)))
    amax = np.max(np.abs(x), axis=1, keepdims=True).astype(F32)
    s = (amax * (F32(1) / F32(448))).astype(F32)
    y = np.clip((x * (F32(1) / s)).astype(F32), -448, 448)
    want = (y.astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * s).astype(F32)
    np.testing.assert_array_equal(got, want)


def test_percentile_clips_at_the_percentile():
    x = _normal((1000,), seed=2)
    q = quantize(jnp.asarray(x), "int8", scale="percentile:99")
    c = np.percentile(np.abs(x), 99)
    np.testing.assert_allclose(float(q.scales), c / 127, rtol=1e-6)  # linear interpolation


def test_mse_scale_is_the_best_clip_ratio_of_its_grid():
    from precisionlab.quant._spec import MSE_GRID, MSE_MIN_RATIO

    x = _normal((4096,), seed=9)
    x64 = x.astype(np.float64)

    def sq_err(q_hat):
        return float(np.sum((np.asarray(q_hat, np.float64) - x64) ** 2))

    amax = np.max(np.abs(x))
    grid = []
    for r in np.geomspace(1.0, MSE_MIN_RATIO, MSE_GRID).astype(F32):
        s = F32(F32(amax * r) * (F32(1) / F32(7)))
        q = np.clip(np.rint((x * (F32(1) / s)).astype(F32)), -7, 7)
        grid.append(sq_err((q * np.float64(s)).astype(F32)))
    e_mse = sq_err(dequantize(quantize(jnp.asarray(x), "int4", scale="mse")))
    e_amax = sq_err(dequantize(quantize(jnp.asarray(x), "int4")))
    assert e_mse <= min(grid) * (1 + 1e-5)
    assert e_mse < 0.8 * e_amax  # clipping a Gaussian's tails pays at 4 bits


# --- accuracy laws ---------------------------------------------------------------------
@pytest.mark.parametrize("bits", [4, 8, 10, 12])
def test_uniform_sqnr_law(bits):
    """A b-bit symmetric quantizer of uniform input has SQNR = 20 log10(2**b - 2) dB (its
    2**b - 1 levels span 2**b - 2 steps), which is within 0.2 dB of 6.02 b from b = 8 on."""
    x = np.random.default_rng(bits).uniform(-1, 1, 1 << 18).astype(F32)
    fmt = IntFormat(name=f"int{bits}", bits=bits)
    x_hat = np.asarray(dequantize(quantize(jnp.asarray(x), fmt)), np.float64)
    x64 = x.astype(np.float64)
    sqnr = 10 * np.log10(np.sum(x64**2) / np.sum((x_hat - x64) ** 2))
    assert abs(sqnr - 20 * np.log10(2**bits - 2)) < 0.05
    if bits >= 8:
        assert abs(sqnr - 6.02 * bits) < 0.2


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2", "e2m3", "e3m2", "fp4", "fp16", "bf16", "e3m4"])
def test_relative_error_at_most_unit_roundoff_and_reached(fmt):
    f = get_format(fmt)
    rng = np.random.default_rng(1)
    lo, hi = math.log2(f.smallest_normal), math.log2(f.max)
    x = np.exp2(rng.uniform(lo, hi, 20000))
    x *= np.where(rng.random(x.size) < 0.5, -1, 1)
    # ties: 1 + u rounds to 1 (even), the largest relative error u / (1 + u)
    ties = (1 + f.unit_roundoff) * np.exp2(np.arange(math.ceil(lo), math.floor(hi)))
    x = np.concatenate([x, ties]).astype(F32)
    x = x[np.abs(x) <= f.max]
    x_hat = np.asarray(dequantize(quantize(jnp.asarray(x), fmt, scale="none")), np.float64)
    rel = np.abs(x_hat - x) / np.abs(x.astype(np.float64))
    u = f.unit_roundoff
    assert rel.max() <= u
    assert rel.max() == u / (1 + u)


# --- jit, vmap, pytree ------------------------------------------------------------------
def test_qarray_is_a_pytree_through_jit():
    x = jnp.asarray(_normal((8, 64)))
    q = jax.jit(lambda x: quantize(x, "int4", block_size=32, scheme="symmetric"))(x)
    assert isinstance(q, QArray) and q.block_size == 32 and q.packed
    leaves, treedef = jax.tree_util.tree_flatten(q)
    q2 = jax.tree_util.tree_unflatten(treedef, leaves)
    assert q2.fmt == q.fmt and q2.shape == q.shape and q2.scale_rule == q.scale_rule
    out = jax.jit(dequantize)(q)
    np.testing.assert_array_equal(out, dequantize(quantize(x, "int4", block_size=32)))


@pytest.mark.parametrize("fmt", ["uint4", "mxint8"])
def test_vmap_equals_rowwise(fmt):
    x = jnp.asarray(_normal((6, 64), seed=4))
    batched = jax.vmap(lambda r: dequantize(quantize(r, fmt)))(x)
    rows = jnp.stack([dequantize(quantize(r, fmt)) for r in x])
    np.testing.assert_array_equal(batched, rows)


def test_stochastic_rounding_is_unbiased_and_keyed():
    x = jnp.full((200000,), 0.3, jnp.float32)
    q = quantize(x, "int8", scale="none", rounding="stochastic", key=jax.random.key(0))
    v = np.asarray(dequantize(q))
    assert set(np.unique(v)) == {0.0, 1.0}
    assert abs(v.mean() - 0.3) < 0.005


def test_nonfinite_group_comes_back_nan_and_empty_input_raises():
    x = np.ones((2, 4), F32)
    x[0, 1] = np.nan
    out = np.asarray(dequantize(quantize(jnp.asarray(x), "int8", axis=0)))
    assert np.all(np.isnan(out[0])) and np.all(out[1] == 1.0)
    with pytest.raises(ValueError, match="empty"):
        quantize(jnp.zeros((0, 4), jnp.float32), "int8")


@pytest.mark.parametrize(
    "fmt,kwargs",
    [
        ("int8", {"axis": 0}),
        ("int4", {"block_size": 128}),
        ("int8", {"axis": 0, "scheme": "asymmetric"}),
        ("mxfp8_e4m3", {}),
    ],
)
def test_nan_reaches_its_group_on_large_arrays(fmt, kwargs):
    # XLA's CPU float max reduce drops NaN once arrays are large (openxla/xla#21461); the group
    # holding a NaN must still come back NaN, as it does for small arrays, and only that group.
    from precisionlab.quant import fake_quant

    x = np.ones((256, 1024), F32)
    x[3, 5] = np.nan
    for f in (
        lambda a: dequantize(quantize(a, fmt, **kwargs)),
        lambda a: fake_quant(a, fmt, **kwargs),
    ):
        out = np.asarray(jax.jit(f)(jnp.asarray(x)))
        nan = np.isnan(out)
        assert nan[3, 5], (fmt, kwargs)
        assert nan.sum() > 1, (fmt, kwargs)  # the whole group, not only the element
        assert not nan[4:].any()


def test_dequantize_dtype():
    x = jnp.asarray(_normal((4, 32)))
    assert dequantize(quantize(x, "int8"), jnp.bfloat16).dtype == jnp.bfloat16


# --- errors ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"fmt": "int9"}, "unknown format 'int9'.*mxfp4"),
        ({"fmt": "int8", "axis": 2}, "axis 2 is out of range"),
        ({"fmt": "mxfp4", "block_size": 16}, "blocks of 32"),
        ({"fmt": "e4m3fn", "scheme": "asymmetric"}, "asymmetric.*integer"),
        ({"fmt": "uint8", "scheme": "symmetric"}, "unsigned"),
        ({"fmt": "int8", "scheme": "skewed"}, "unknown scheme 'skewed'"),
        ({"fmt": "int8", "scale": "max"}, "unknown scale 'max'"),
        ({"fmt": "int8", "scale": "percentile:120"}, "percentile"),
        ({"fmt": "int8", "scale_format": "fp8"}, "unknown scale_format 'fp8'"),
        ({"fmt": "int8", "scale_rule": "floor"}, "power-of-two"),
        ({"fmt": "mxfp4", "scale_rule": "round"}, "unknown scale_rule 'round'"),
        ({"fmt": "int8", "rounding": "banker"}, "unknown rounding mode 'banker'"),
        ({"fmt": "int8", "rounding": "stochastic"}, "needs a PRNG key"),
        ({"fmt": "int8", "block_size": 0}, "block_size must be a positive int"),
        ({"fmt": "e4m3fn", "pack_codes": True}, "4-bit"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        quantize(jnp.ones((4, 8), jnp.float32), **kwargs)


@pytest.mark.parametrize("fmt", ["int8", "nvfp4"])
def test_unknown_option_raises_type_error_naming_it_and_the_allowed(fmt):
    from precisionlab.quant import fake_quant

    x = jnp.ones((4, 32), jnp.float32)
    calls = [lambda: fake_quant(x, fmt, axs=0)]
    if fmt == "int8":
        calls.append(lambda: quantize(x, fmt, axs=0))
    for call in calls:
        with pytest.raises(TypeError, match=r"unknown quantization option 'axs'.*block_size"):
            call()


def test_quant_options_are_documented_once_and_taken_by_both_entry_points():
    """Every QuantOptions key has its entry in QuantOptions' docstring, and quantize and
    fake_quant take each one (a non-default value changes the result or is accepted)."""
    import inspect

    from precisionlab.quant import QuantOptions, fake_quant

    doc = inspect.getdoc(QuantOptions)
    names = list(QuantOptions.__annotations__)
    assert names == [
        "axis", "block_size", "scheme", "scale", "scale_format", "scale_rule", "rounding",
        "full_range",
    ]  # fmt: skip
    for name in names:
        assert f"\n  {name}: " in doc, name
    x = jnp.linspace(-3.0, 5.0, 64, dtype=jnp.float32).reshape(2, 32)
    given = {
        "axis": 0, "block_size": 16, "scheme": "asymmetric", "scale": "mse",
        "scale_format": "pow2", "scale_rule": "floor", "rounding": "toward_zero",
    }  # fmt: skip
    base = dequantize(quantize(x, "int4"))
    for name, value in given.items():
        options = {name: value}
        if name == "scale_rule":
            options["scale_format"] = "pow2"
        q = dequantize(quantize(x, "int4", **options))
        assert not np.array_equal(np.asarray(q), np.asarray(base)), name
        np.testing.assert_array_equal(np.asarray(fake_quant(x, "int4", **options)), q)
    # full_range: values clipped below the range take the code -8 (0x8), not -7
    clip = {"scale": "percentile:50", "pack_codes": False}
    assert 8 in np.asarray(quantize(x, "int4", full_range=True, **clip).codes)
    assert 8 not in np.asarray(quantize(x, "int4", **clip).codes)
    wide = dequantize(quantize(x, "int4", full_range=True, scale="percentile:50"))
    fake = fake_quant(x, "int4", full_range=True, scale="percentile:50")
    np.testing.assert_array_equal(np.asarray(fake), np.asarray(wide))


def test_bad_input_dtype_raises_type_error():
    with pytest.raises(TypeError, match="int32"):
        quantize(jnp.ones((4,), jnp.int32), "int8")
    with pytest.raises(TypeError, match="QArray"):
        dequantize(jnp.ones(3))


def test_every_scale_method_listed_is_accepted_and_only_those():
    # SCALE_METHODS is the parser's list: "auto" used to be accepted but not listed.
    from precisionlab.quant import SCALE_METHODS
    from precisionlab.quant._spec import parse_scale

    fmt = get_format("int8")
    for method in SCALE_METHODS:
        parse_scale(method.replace("<p>", "99.9"), fmt)
    with pytest.raises(ValueError) as err:
        parse_scale("median", fmt)
    assert all(method in str(err.value) for method in SCALE_METHODS)
