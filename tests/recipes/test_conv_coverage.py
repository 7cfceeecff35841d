"""Convolutions are covered: recipes quantize them (forward and both gradients) as the GEMM
over their im2col patches, emulate and the hardware models compute them as that implicit GEMM
(K = kernel taps, then input channels fastest), telemetry observes them, and what a rule could
act on but does not (ragged_dot, integer matmuls) is listed and warned about once.

Oracles: patches built here in numpy float64 (K order (kh, kw, C_in)), quantized by the float64
/ ml_dtypes references of each recipe's rule in tests/recipes/test_recipes.py, times in float64;
lax.conv_general_dilated itself for the layouts; hardware.gemm on those numpy patches for the
tensor-core model.
"""

from __future__ import annotations

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from test_recipes import cast, oracle_blockwise, oracle_current, oracle_mx, oracle_nvfp4
from test_recipes import oracle_rowwise as _oracle_rowwise

from precisionlab import hardware, recipes, telemetry
from precisionlab.emulate import emulate
from precisionlab.hardware._conv import conv_gemm
from precisionlab.intercept import SkippedOperationWarning, _interpret

F32 = np.float32


# --- numpy im2col, K order (kh, kw, c) ------------------------------------------------------
def np_patches(x: np.ndarray, kh: int, kw: int) -> np.ndarray:
    """(N*OH*OW, kh*kw*C) float64 patches of an NHWC ``x``, VALID, stride 1."""
    n, h, w, c = x.shape
    oh, ow = h - kh + 1, w - kw + 1
    p = np.empty((n, oh, ow, kh, kw, c))
    for a in range(kh):
        for b in range(kw):
            p[:, :, :, a, b, :] = x[:, a : a + oh, b : b + ow, :]
    return p.reshape(n * oh * ow, kh * kw * c)


def np_col2im(dp: np.ndarray, x_shape, kh: int, kw: int) -> np.ndarray:
    n, h, w, c = x_shape
    oh, ow = h - kh + 1, w - kw + 1
    d = dp.reshape(n, oh, ow, kh, kw, c)
    dx = np.zeros(x_shape)
    for a in range(kh):
        for b in range(kw):
            dx[:, a : a + oh, b : b + ow, :] += d[:, :, :, a, b, :]
    return dx


def _dq(name: str, t: np.ndarray, kind: str) -> np.ndarray:
    """The dequantized (R, K) operand ``t`` of ``kind`` by the recipe's rule (float64)."""
    t = t.astype(F32)[None]
    if name in ("current", "delayed_unit"):
        fmt = "float8_e5m2" if kind == "g" else "float8_e4m3fn"
        if name == "delayed_unit":  # the delayed recipe's first step: scale 1, saturating
            return cast(t.astype(np.float64), fmt)[0]
        q, s = oracle_current(t, fmt)
        return (q / s)[0]
    if name == "rowwise":
        q, s = _oracle_rowwise(t)
        return (q / s)[0]
    if name == "blockwise":
        q, s = oracle_blockwise(t, 128, kind == "w")
        return (q / s)[0]
    if name in ("mxfp8", "mxfp4"):
        fmt, rule = ("float8_e4m3fn", "rceil") if name == "mxfp8" else ("float4_e2m1fn", "floor")
        q, xs = oracle_mx(t, fmt, rule)
        return (q * xs)[0]
    if name == "nvfp4":
        q, sb, enc = oracle_nvfp4(t, 16, kind == "w")
        return (q * sb / np.float64(enc))[0]
    raise AssertionError(name)


def _recipe(name: str):
    if name == "nvfp4":
        return recipes.get_recipe("nvfp4", stochastic_gradients=False, hadamard=False)
    return recipes.get_recipe(name)


def _close(got, want, bound):
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= bound), float(np.max(err - bound))


def _gemm_bound(a, b):
    """float32 accumulation error of a (M, K) x (N, K) GEMM, generous."""
    return a.shape[-1] * 2.0**-23 * (np.abs(a) @ np.abs(b).T) + 1e-30


# (2, 9, 9, 32) NHWC * (2, 2, 32, 128) HWIO, VALID: M = 128 positions, K = 128, O = 128, so
# every block and 2-D tile size (16, 32, 128) divides every GEMM's K and rows
@pytest.fixture(scope="module")
def conv_data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 9, 9, 32)).astype(F32)
    x[0, :, :, 3] *= 50.0  # an outlier channel: the per-row and per-block scales differ
    w = (rng.standard_normal((2, 2, 32, 128)) * 0.1).astype(F32)
    g = rng.standard_normal((2, 8, 8, 128)).astype(F32)
    return x, w, g


def _conv(recipe):
    def f(x, w):
        return recipes.conv_general_dilated(
            x, w, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"), recipe=recipe
        )

    return f


def _check_three_gemms(name, conv_data):
    x, w, g = conv_data
    y, vjp = jax.vjp(_conv(_recipe(name)), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g))
    p = np_patches(x.astype(np.float64), 2, 2)  # (M, K)
    wr = w.reshape(-1, 128).T.astype(np.float64)  # kernel rows (O, K), K order (kh, kw, c)
    gm = g.reshape(-1, 128).astype(np.float64)  # (M, O)
    # fprop: patches along K per position, kernel along K per output feature
    qp, qw = _dq(name, p, "x"), _dq(name, wr, "w")
    want = qp @ qw.T
    _close(np.asarray(y).reshape(-1, 128), want, _gemm_bound(qp, qw) + 1e-6 * np.abs(want))
    # dgrad: g along O per position, kernel^T (K, O) along O; then the windows summed
    qg, qwt = _dq(name, gm, "g"), _dq(name, np.ascontiguousarray(wr.T), "w")
    dp = qg @ qwt.T
    bound = np_col2im(_gemm_bound(qg, qwt) + 1e-6 * np.abs(dp), x.shape, 2, 2)
    _close(dx, np_col2im(dp, x.shape, 2, 2), bound + 1e-6 * np.abs(np_col2im(dp, x.shape, 2, 2)))
    # wgrad: g^T (O, M) and patches^T (K, M), both along M
    qgt, qpt = _dq(name, np.ascontiguousarray(gm.T), "g"), _dq(name, np.ascontiguousarray(p.T), "x")
    dwr = qgt @ qpt.T  # (O, K)
    got = np.asarray(dw).reshape(-1, 128).T
    _close(got, dwr, _gemm_bound(qgt, qpt) + 1e-6 * np.abs(dwr))
    # the quantization has an effect: the forward is not the float64 convolution
    assert np.max(np.abs(np.asarray(y).reshape(-1, 128) - p @ wr.T)) > 1e-3


@pytest.mark.parametrize("name", ["current", "blockwise"])
def test_conv_gemms_match_the_im2col_oracle(name, conv_data):
    _check_three_gemms(name, conv_data)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rowwise", "mxfp8", "mxfp4", "nvfp4"])
def test_conv_gemms_match_the_im2col_oracle_all_rules(name, conv_data):
    _check_three_gemms(name, conv_data)


def test_conv_gw_hp_keeps_wgrad_exact_and_delayed_observes_the_patches(conv_data):
    x, w, g = conv_data[0][:, :5, :5], conv_data[1], conv_data[2][:, :4, :4]
    dw = jax.jit(lambda x, w: jax.vjp(_conv("rowwise_with_gw_hp"), x, w)[1](g)[1])(x, w)
    p = np_patches(x.astype(np.float64), 2, 2)
    want = (g.reshape(-1, 128).T.astype(np.float64) @ p).T.reshape(w.shape)
    _close(dw, want, 128 * 2.0**-23 * np.abs(want) + 1e-5)
    # delayed: its first step quantizes with scale 1; the observed amaxes are the patches',
    # the kernel's and the output gradient's
    rec = recipes.get_recipe("delayed")
    state = recipes.init_site_state(rec)

    def loss(st, x, w):
        y = recipes.conv_general_dilated(
            x, w, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"), recipe=rec,
            state=st,
        )  # fmt: skip
        return jnp.sum(y * g)

    grads = jax.jit(jax.grad(loss))(state, x, w)
    seen = np.asarray(grads["probe"])
    np.testing.assert_array_equal(seen, [np.abs(p).max(), np.abs(w).max(), np.abs(g).max()])


def test_implicit_gemm_plan_equals_lax_on_every_layout():
    """Exact (integer-valued float32: every product and sum exact) on strides, padding
    (negative too), both dilations, feature and batch groups, 1-D to 3-D, any layout."""
    rng = np.random.default_rng(1)
    cases = [
        ((2, 3, 9, 8), (4, 3, 3, 2), dict(window_strides=(1, 1), padding="SAME")),
        ((2, 9, 8, 3), (3, 2, 3, 4), dict(window_strides=(2, 1), padding=((1, 2), (0, -1)),
         dimension_numbers=("NHWC", "HWIO", "NHWC"), rhs_dilation=(2, 1), lhs_dilation=(1, 2))),
        ((2, 6, 9), (6, 2, 3), dict(window_strides=(2,), padding="VALID", feature_group_count=3)),
        ((6, 4, 9), (6, 4, 3), dict(window_strides=(1,), padding="VALID", batch_group_count=3)),
        ((6, 4, 9, 5), (6, 4, 3, 2), dict(window_strides=(1, 2), padding=((1, 1), (2, 0)),
         batch_group_count=2, dimension_numbers=("NCHW", "OIHW", "NHWC"))),
        ((1, 2, 5, 5, 5), (3, 2, 2, 2, 2), dict(window_strides=(1, 1, 2), padding="SAME")),
    ]  # fmt: skip
    for ls, rs, kw in cases:
        x = rng.integers(-3, 4, ls).astype(F32)
        w = rng.integers(-3, 4, rs).astype(F32)
        want = lax.conv_general_dilated(x, w, precision="highest", **kw)
        plan = conv_gemm(ls, rs, **kw)
        got = jax.jit(lambda x, w, plan=plan: plan.output(
            jnp.einsum("gmk,gnk->gmn", plan.patches(x), plan.kernel_rows(w))))(x, w)  # fmt: skip
        assert plan.output_shape() == want.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        # gemm_output is output's inverse: the GEMM layout back, bit for bit
        gemm = np.arange(plan.groups * plan.m * plan.n, dtype=F32).reshape(
            plan.groups, plan.m, plan.n
        )
        np.testing.assert_array_equal(np.asarray(plan.gemm_output(plan.output(gemm))), gemm)


def test_hardware_conv_is_the_gemm_over_numpy_patches():
    """hardware.conv_general_dilated and emulate's tensor-core model: the GEMM of the
    (kh, kw, c)-ordered patches, bit for bit; a different K order gives other bits."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 6, 6, 64)).astype(ml_dtypes.bfloat16)
    w = (rng.standard_normal((3, 3, 64, 8)) / 16).astype(ml_dtypes.bfloat16)
    p = np_patches(x.astype(np.float64), 3, 3).astype(ml_dtypes.bfloat16)  # (16, 576)
    wr = w.reshape(-1, 8).astype(ml_dtypes.bfloat16)  # (576, 8): K order (kh, kw, c)
    kw = dict(device="h100", library="cublaslt", fast_accumulation=True)
    want = np.asarray(hardware.gemm(jnp.asarray(p), jnp.asarray(wr), **kw))
    dn = ("NHWC", "HWIO", "NHWC")
    got = hardware.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=dn,
                                        preset="h100-cublaslt-fast")  # fmt: skip
    np.testing.assert_array_equal(np.asarray(got).reshape(-1, 8), want)
    # channel-major K (c, kh, kw) sums in another order: the truncating chain gives other bits
    perm = np.arange(576).reshape(3, 3, 64).transpose(2, 0, 1).ravel()
    other = np.asarray(hardware.gemm(jnp.asarray(p[:, perm]), jnp.asarray(wr[perm]), **kw))
    assert not np.array_equal(other, want)
    # emulate runs every convolution through its matmul model the same way
    f = lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=dn)  # noqa: E731
    em = emulate(f, "bf16", hardware="h100-cublaslt-fast")(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_array_equal(
        np.asarray(em, np.float32).reshape(-1, 8), want.astype(ml_dtypes.bfloat16).astype(F32)
    )


def test_emulate_rounds_the_convolution_gradients_too():
    """emulate's backward convolutions (the transposed ones of the VJP) are GEMMs over their
    own patches: the data gradient equals float64 col2im of (g W^T) rounded to bfloat16 within
    one bfloat16 ulp of float32 accumulation, and it is a bfloat16 value."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 5, 5, 4)).astype(ml_dtypes.bfloat16)
    w = (rng.standard_normal((2, 2, 4, 8)) / 4).astype(ml_dtypes.bfloat16)
    g = rng.standard_normal((2, 4, 4, 8)).astype(ml_dtypes.bfloat16)
    dn = ("NHWC", "HWIO", "NHWC")
    f = lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=dn)  # noqa: E731
    _, vjp = jax.vjp(emulate(f, "bf16", hardware="float32"), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g))
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    dp = g.reshape(-1, 8).astype(np.float64) @ w.reshape(-1, 8).astype(np.float64).T
    want = np_col2im(dp, x.shape, 2, 2)
    ulp = np.abs(want) * 2.0**-7 + 1e-30
    assert np.all(np.abs(np.asarray(dx, np.float64) - want) <= ulp)


# --- any model: an Equinox CNN under every recipe ------------------------------------------
@pytest.fixture(scope="module")
def eqx_cnn():
    k1, k2 = jax.random.split(jax.random.key(0))

    class CNN(eqx.Module):  # as Equinox's CNN-on-MNIST tutorial writes one
        layers: list

        def __init__(self, key):
            a, b = jax.random.split(key)
            self.layers = [
                eqx.nn.Conv2d(1, 8, kernel_size=3, key=a), jax.nn.relu, jnp.ravel,
                eqx.nn.Linear(8 * 6 * 6, 10, key=b),
            ]  # fmt: skip

        def __call__(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    model = CNN(k1)
    params, static = eqx.partition(model, eqx.is_array)
    x = jax.random.normal(k2, (4, 1, 8, 8))

    def fwd(p, x):
        return jax.vmap(eqx.combine(p, static))(x)

    return fwd, params, x


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_equinox_cnn_changes_under_a_recipe_and_reports_its_conv(name, eqx_cnn):
    fwd, params, x = eqx_cnn
    ref = fwd(params, x)
    ap = recipes.apply(fwd, name)
    names = [s.name for s in ap.sites(params, x)]
    assert names == ["conv_general_dilated[0]", "dot_general[0]"]
    assert "conv_general_dilated[0]" in ap.report(params, x)
    y = jax.jit(ap)(params, x, key=jax.random.key(0))
    assert float(jnp.max(jnp.abs(y - ref))) > 1e-3
    # excluding both leaves it bitwise (the conv alone: test_every_recipe_quantizes_the_conv)
    none = recipes.apply(fwd, name, exclude=["conv_general_dilated[0]", "dot_general[0]"])
    np.testing.assert_array_equal(np.asarray(none(params, x)), np.asarray(ref))


@pytest.mark.slow
def test_every_recipe_quantizes_the_conv(eqx_cnn):
    fwd, params, x = eqx_cnn
    ref = np.asarray(fwd(params, x))
    for name in recipes.RECIPE_NAMES:
        if name == "fp32":
            continue
        ap = recipes.apply(fwd, name, include=["conv_general_dilated[0]"])
        state = ap.init_state(params, x)
        y = np.asarray(jax.jit(ap)(params, x, state=state or None, key=jax.random.key(0)))
        assert not np.array_equal(y, ref), name


# --- telemetry observes convolutions; unknown ops raise ------------------------------------
def test_telemetry_observes_the_conv_as_its_gemm(eqx_cnn):
    fwd, params, x = eqx_cnn
    obs = telemetry.observe(lambda p, x: jnp.sum(fwd(p, x) ** 2))
    value, _, stats = jax.jit(obs.value_and_grad())(params, x)
    st = stats["conv_general_dilated[0]"]
    xn = np.asarray(x)
    p = np_patches(np.moveaxis(xn, 1, -1).astype(np.float64), 3, 3)  # (4*36, 9)
    assert int(st["lhs"].n) == p.size and float(st["lhs"].amax) == np.abs(p).max()
    assert int(st["rhs"].n) == 8 * 9 and int(st["out"].n) == 4 * 8 * 36
    assert int(st["grad"].n) == 4 * 8 * 36 and float(st["grad"].amax) > 0
    # unchanged computation
    np.testing.assert_array_equal(np.asarray(value), np.asarray(jnp.sum(fwd(params, x) ** 2)))


def test_unknown_ops_name_raises_listing_what_exists():
    with pytest.raises(ValueError, match=r"not_a_primitive.*not a JAX primitive.*integer_pow"):
        telemetry.observe(lambda x: x, ops=("not_a_primitive",))
    telemetry.observe(lambda x: x, ops=("exp", "conv_general_dilated"))  # real ones pass


# --- what a rule could act on but does not: listed and warned once ---------------------------
def _ragged(x, w):
    h = lax.ragged_dot(x, w, jnp.array([3, 3], jnp.int32))
    i = lax.dot_general(jnp.ones((2, 3), jnp.int32), jnp.ones((3, 2), jnp.int32),
                        (((1,), (0,)), ((), ())))  # fmt: skip
    return h @ jnp.ones((3, 2)) + jnp.sum(i)


def test_ragged_and_integer_matmuls_are_listed_and_warned_once(monkeypatch):
    monkeypatch.setattr(_interpret, "_WARNED", set())
    x, w = jnp.ones((6, 4)), jnp.ones((2, 4, 3))
    ap = recipes.apply(_ragged, "mxfp8")
    with pytest.warns(SkippedOperationWarning) as rec:
        report = ap.report(x, w)
    msgs = sorted(str(r.message) for r in rec)
    assert any("ragged_dot_general" in m for m in msgs) and any("int32" in m for m in msgs)
    assert "ragged_dot_general[0] (no rule for ragged_dot_general)" in report
    assert "dot_general[0]" in report and "skipped: int32 x int32 operands" in report
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the second trace is silent
        ap(x, w)
        assert [s.name for s in ap.intercepted.skipped(x, w)] == [
            "dot_general[0]", "ragged_dot_general[0]",
        ]  # fmt: skip
    obs = telemetry.observe(_ragged)
    with pytest.warns(SkippedOperationWarning, match="telemetry"):
        assert [s.primitive for s in obs.skipped(x, w)] == ["ragged_dot_general"]
    assert "1 not observed: ragged_dot_general[0] (no rule for ragged_dot_general)" in (
        obs.report(x, w)
    )
