"""Recipes against independent float64 numpy oracles of each cited rule.

Every oracle below is written from the rule's statement (TE, torchao, DeepSeek-V3, OCP MX,
NVFP4), with ml_dtypes casts for element rounding; none calls precisionlab.
"""

from __future__ import annotations

import fractions
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from precisionlab import recipes as R
from precisionlab.recipes import _scaling as S

F32 = np.float32
E4M3 = ml_dtypes.float8_e4m3fn
E5M2 = ml_dtypes.float8_e5m2
_ML = {
    "float8_e4m3fn": (E4M3, 448.0, 8, 3),
    "float8_e5m2": (E5M2, 57344.0, 15, 2),
    "float6_e2m3fn": (ml_dtypes.float6_e2m3fn, 7.5, 2, 3),
    "float6_e3m2fn": (ml_dtypes.float6_e3m2fn, 28.0, 4, 2),
    "float4_e2m1fn": (ml_dtypes.float4_e2m1fn, 6.0, 2, 1),
}


# --- inputs --------------------------------------------------------------------------------
def hard_rows(k: int = 256, seed: int = 0) -> np.ndarray:
    """(1, 12, k) float32 rows: zeros, subnormals, tiny, huge, mixed magnitudes, a zero
    block, exact powers of two, values that saturate under a stale scale."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((12, k))
    x[0] = 0.0  # an all-zero row
    x[1] *= 1e-40  # float32 subnormals only
    x[2] *= 1e-30
    x[3] *= 1e30
    x[4] *= 10.0 ** rng.uniform(-20, 20, k)  # every magnitude in one row
    x[5, : k // 2] = 0.0  # zero blocks inside a row
    x[6] = np.ldexp(1.0, rng.integers(-30, 30, k))  # exact powers of two
    x[7] *= 1e-38  # straddling the normal/subnormal boundary
    x[8, 0] = 1000.0  # one outlier
    x[9] = rng.uniform(-448, 448, k)
    x[10, ::3] = 0.0
    return x.astype(F32)[None]


def nonfinite_rows(k: int = 64) -> np.ndarray:
    x = np.random.default_rng(1).standard_normal((3, k)).astype(F32)
    x[0, 5] = np.nan
    x[1, 7] = np.inf
    return x[None]


def cast(v: np.ndarray, fmt: str) -> np.ndarray:
    """Saturating round-to-nearest-even cast (NaN stays NaN), back to float64."""
    dt, mx, _, _ = _ML[fmt]
    return np.clip(v, -mx, mx).astype(F32).astype(dt).astype(np.float64)


def floor_log2(a: np.ndarray) -> np.ndarray:
    _, e = np.frexp(a)
    return (e - 1).astype(np.int64)


# --- oracles -------------------------------------------------------------------------------
def oracle_current(x, fmt, eps=1e-12, pow2=False):
    """torchao tensorwise / TE current: s = f32(max / max(amax, eps)) in float64."""
    _, mx, _, _ = _ML[fmt]
    a = np.max(np.abs(x.astype(np.float64)))
    s = F32(mx / max(a, eps))
    if pow2:
        s = F32(np.ldexp(1.0, floor_log2(np.float64(s))))
    q = cast((x * s).astype(np.float64), fmt)  # x * s is a float32 product, as torchao
    return q, s


def oracle_rowwise(x, fmt="float8_e4m3fn", eps=1e-12):
    _, mx, _, _ = _ML[fmt]
    a = np.max(np.abs(x.astype(np.float64)), axis=-1, keepdims=True)
    s = (mx / np.maximum(a, eps)).astype(F32)
    s = np.ldexp(1.0, floor_log2(s.astype(np.float64))).astype(F32)
    return cast((x * s).astype(np.float64), fmt), s


def oracle_block_scale(a):
    """TE Float8BlockScaling pow2 scale of a float64 amax: f32(448 / amax), amax 0 -> 1,
    inf -> 2**127, then 2**floor(log2)."""
    with np.errstate(divide="ignore", over="ignore"):
        s = np.where(a == 0, F32(1), (F32(448) / a.astype(F32)).astype(F32))
    s = np.where(np.isinf(s), F32(2.0**127), s).astype(np.float64)
    return np.ldexp(1.0, floor_log2(s))


def oracle_blockwise(x, block=128, two_d=False):
    b, r, k = x.shape
    x64 = x.astype(np.float64)
    if two_d:
        g = np.abs(x64).reshape(b, r // block, block, k // block, block)
        a = g.max(axis=(2, 4), keepdims=True)
        a = np.broadcast_to(a, g.shape).reshape(x.shape)
    else:
        g = np.abs(x64).reshape(b, r, k // block, block)
        a = np.broadcast_to(g.max(-1, keepdims=True), g.shape).reshape(x.shape)
    s = oracle_block_scale(a)
    return cast(x64 * s, "float8_e4m3fn"), s


def even_round(a, m):
    """torchao EVEN: add half a unit of fraction bit m, keep sign and exponent bits."""
    bits = a.astype(F32).view(np.uint32)
    r = ((bits + np.uint32(1 << (22 - m))) & np.uint32(0x7F800000)).view(F32)
    return r.astype(np.float64)


def oracle_mx(x, fmt, rule, block=32):
    _, mx, emax, m = _ML[fmt]
    x64 = x.astype(np.float64)
    g = x64.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    a = np.abs(g).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        if rule == "floor":
            e = np.floor(np.log2(a)) - emax
        elif rule == "ceil":
            e = np.ceil(np.log2(a)) - emax
        elif rule == "rceil":
            e = np.ceil(np.log2(a / mx))
        else:
            e = np.floor(np.log2(even_round(a, m))) - emax
    e = np.clip(np.where(a == 0, -127, np.nan_to_num(e, neginf=-127)), -127, 127)
    xs = np.ldexp(1.0, e.astype(int))
    q = cast(g / xs, fmt)
    return q.reshape(x.shape), np.broadcast_to(xs, g.shape).reshape(x.shape)


def oracle_nvfp4(x, block=16, two_d=False):
    x32 = x.astype(F32)
    ga = np.float32(np.max(np.abs(x32)))
    s_enc = F32(1.0) if ga == 0 else F32(F32(2688.0) / ga)
    b, r, k = x.shape
    if two_d:
        g = np.abs(x32).reshape(b, r // block, block, k // block, block)
        a = np.broadcast_to(g.max(axis=(2, 4), keepdims=True), g.shape).reshape(x.shape)
    else:
        g = np.abs(x32).reshape(b, r, k // block, block)
        a = np.broadcast_to(g.max(-1, keepdims=True), g.shape).reshape(x.shape)
    sixth = F32(F32(1) / F32(6))
    sb = cast(((a * sixth).astype(F32) * s_enc).astype(F32).astype(np.float64), "float8_e4m3fn")
    sb32 = sb.astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        enc = np.where(sb32 == 0, F32(0), (s_enc / np.where(sb32 == 0, F32(1), sb32)).astype(F32))
    y = (x32 * enc.astype(F32)).astype(F32)
    return cast(y.astype(np.float64), "float4_e2m1fn"), sb, s_enc


def assert_same(got, want):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(got[ok], want[ok])


# --- codes and scales, code for code -------------------------------------------------------
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
def test_current_matches_torchao_rule(fmt, pow2):
    x = hard_rows()
    for rows in (x, x[:, 1:3], x[:, :1]):  # mixed; subnormal/tiny only; all zero
        q, s = S.tensorwise(jnp.asarray(rows), S.FORMATS[fmt], eps=1e-12, pow2_scales=pow2)
        want_q, want_s = oracle_current(rows, fmt, pow2=pow2)
        assert_same(q.elems, want_q)
        assert float(np.asarray(s).reshape(())) == float(want_s)
        assert float(q.row_inv.reshape(())) == float(F32(1) / want_s)


def test_rowwise_matches_torchao_rule():
    x = hard_rows()
    q, s = S.per_row(jnp.asarray(x), S.E4M3, eps=1e-12)
    want_q, want_s = oracle_rowwise(x)
    assert_same(q.elems, want_q)
    assert_same(s, want_s)
    assert_same(q.row_inv, 1.0 / want_s.astype(np.float64))


@pytest.mark.parametrize("two_d", [False, True])
def test_blockwise_matches_deepseek_te_rule(two_d):
    # 128 rows for 2-D tiles: the hard rows repeated, so every kind of row meets 1-D tiles,
    # and 2-D tiles mixing them; plus 20 rows of subnormals only
    x = np.concatenate([hard_rows(256)] * 11, axis=1)[:, :128].copy()
    x[0, 20:40] *= 1e-40
    q, s = S.block_pow2(jnp.asarray(x), S.E4M3, 128, two_d=two_d)
    want_q, want_s = oracle_blockwise(x, 128, two_d)
    assert_same(q.elems, want_q)
    assert_same(s, want_s)


_MX_CASES = [
    pytest.param(f, r, marks=() if (f == "float8_e4m3fn" or r == "floor") else pytest.mark.slow)
    for f in ("float8_e4m3fn", "float8_e5m2", "float6_e2m3fn", "float4_e2m1fn")
    for r in ("floor", "ceil", "rceil", "even")
]


@pytest.mark.parametrize(("fmt", "rule"), _MX_CASES)
def test_mx_matches_ocp_torchao_te_rules(fmt, rule):
    x = hard_rows(256)
    q, xs = S.mx_blocks(jnp.asarray(x), S.FORMATS[fmt], 32, rule)
    want_q, want_xs = oracle_mx(x, fmt, rule)
    assert_same(q.elems, want_q)
    assert_same(xs, want_xs)
    # the dequantized value is elems * X, exactly (subnormal products included)
    assert_same(q.dequantize(), want_q * want_xs)


@pytest.mark.parametrize("two_d", [False, True])
def test_nvfp4_matches_two_level_rule(two_d):
    x = hard_rows(64)[:, :]
    x = np.concatenate([x, x[:, :4] * 3.0], axis=1)  # 16 rows for 16 x 16 tiles
    q, sb, s_enc = S.nvfp4(jnp.asarray(x), 16, two_d=two_d)
    want_q, want_sb, want_enc = oracle_nvfp4(x, 16, two_d)
    assert float(s_enc.reshape(())) == float(want_enc)
    assert_same(sb, want_sb)
    assert_same(q.elems, want_q)


def test_nvfp4_all_zero_tensor():
    q, sb, s_enc = S.nvfp4(jnp.zeros((1, 2, 32)), 16, two_d=False)
    assert (
        float(s_enc.reshape(())) == 1.0
        and not np.any(np.asarray(q.elems))
        and not np.any(np.asarray(sb))
    )


def test_nonfinite_input_poisons_its_group():
    x = nonfinite_rows()
    q, s = jax.jit(lambda t: S.per_row(t, S.E4M3, eps=1e-12))(jnp.asarray(x))
    v = np.asarray(q.dequantize())
    assert np.all(np.isnan(v[0, :2])) and np.all(np.isfinite(v[0, 2]))
    assert np.all(np.isnan(np.asarray(s)[0, :2])) and np.isfinite(np.asarray(s)[0, 2, 0])
    v = jax.jit(lambda t: S.mx_blocks(t, S.E4M3, 32, "floor")[0].dequantize())(jnp.asarray(x))
    v = np.asarray(v)
    assert np.all(np.isnan(v[0, 0, :32])) and np.all(np.isfinite(v[0, 0, 32:]))
    v = jax.jit(lambda t: S.tensorwise(t, S.E4M3, eps=1e-12, pow2_scales=False)[0].dequantize())(
        jnp.asarray(x)
    )
    assert np.all(np.isnan(np.asarray(v)))


def test_delayed_quantization_saturates_with_stale_scale():
    x = jnp.asarray(hard_rows())
    q = S.with_scale(x, jnp.float32(2.0), S.E4M3)
    want = cast((np.asarray(x) * F32(2)).astype(np.float64), "float8_e4m3fn")
    assert_same(q.elems, want)
    assert float(np.max(np.abs(np.asarray(q.elems)))) == 448.0  # saturated, not inf


# --- the VJP: dgrad and wgrad against float64 GEMMs of the prescribed operands -------------
def _bound(qa, qb):
    """|err| <= K * 2**-23 * (|a| @ |b|^T) (float32 accumulation, generous)."""
    k = qa.shape[-1]
    return k * 2.0**-23 * np.einsum("bmk,bnk->bmn", np.abs(qa), np.abs(qb)) + 1e-30


def _close(got, want, bound):
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= bound), float(np.max(err - bound))


QUANT = {
    "current": lambda t, kind: (
        oracle_current(t, "float8_e5m2" if kind == "g" else "float8_e4m3fn")[0]
        / oracle_current(t, "float8_e5m2" if kind == "g" else "float8_e4m3fn")[1]
    ),
    "rowwise": lambda t, kind: oracle_rowwise(t)[0] / oracle_rowwise(t)[1],
    "blockwise": lambda t, kind: (
        oracle_blockwise(t, 128, kind == "w")[0] * (1.0 / oracle_blockwise(t, 128, kind == "w")[1])
    ),
    "mxfp8": lambda t, kind: np.prod(oracle_mx(t, "float8_e4m3fn", "rceil"), axis=0),
    "nvfp4": lambda t, kind: (lambda q, sb, enc: q * sb / np.float64(enc))(
        *oracle_nvfp4(t, 16, kind == "w")
    ),
}


@pytest.mark.parametrize("name", list(QUANT))
def test_vjp_gemms_use_the_prescribed_operands(name):
    rng = np.random.default_rng(3)
    m, k, n = 128, 256, 128
    x = rng.standard_normal((m, k)).astype(F32)
    w = (rng.standard_normal((k, n)) * 0.05).astype(F32)
    g = rng.standard_normal((m, n)).astype(F32)
    kw = {"stochastic_gradients": False, "hadamard": False} if name == "nvfp4" else {}
    recipe = R.get_recipe(name, **kw)
    y, vjp = jax.vjp(lambda a, b: R.matmul(a, b, recipe=recipe), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g))
    q = QUANT[name]
    # canonical (B, R, K) operands of each GEMM, quantized from the high-precision tensors
    qx = q(x[None], "x")
    qw = q(np.ascontiguousarray(w.T)[None], "w")  # w as (N, K)
    want_y = np.einsum("bmk,bnk->bmn", qx, qw)[0]
    _close(y, want_y, _bound(qx, qw)[0] + 1e-6 * np.abs(want_y))
    qg = q(g[None], "g")  # along N
    qwt = q(w[None], "w")  # w^T as (K, N): along N
    want_dx = np.einsum("bmn,bkn->bmk", qg, qwt)[0]
    _close(dx, want_dx, _bound(qg, qwt)[0] + 1e-6 * np.abs(want_dx))
    qgt = q(np.ascontiguousarray(g.T)[None], "g")  # g^T (N, M): along M
    qxt = q(np.ascontiguousarray(x.T)[None], "x")  # x^T (K, M): along M
    want_dw = np.einsum("bnm,bkm->bkn", qgt, qxt)[0]
    _close(dw, want_dw, _bound(qgt, qxt)[0].T + 1e-6 * np.abs(want_dw))


def test_rowwise_with_gw_hp_keeps_wgrad_exact():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((16, 64)).astype(F32)
    w = rng.standard_normal((64, 32)).astype(F32)
    g = rng.standard_normal((16, 32)).astype(F32)
    _, vjp = jax.vjp(lambda a, b: R.matmul(a, b, recipe="rowwise_with_gw_hp"), x, w)
    dx, dw = vjp(jnp.asarray(g))
    want = x.astype(np.float64).T @ g
    _close(dw, want, 64 * 2.0**-23 * (np.abs(x).T @ np.abs(g)))
    _, vjp_q = jax.vjp(lambda a, b: R.matmul(a, b, recipe="rowwise"), x, w)
    dx_q, _ = vjp_q(jnp.asarray(g))
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx_q))  # dgrad still quantized


def test_dot_general_layouts_match_lax():
    """Batch and several contraction/free axes: the fp32 reference equals lax.dot_general."""
    rng = np.random.default_rng(5)
    a = rng.standard_normal((3, 4, 5, 6)).astype(F32)
    b = rng.standard_normal((3, 6, 7, 4)).astype(F32)
    dims = (((1, 3), (3, 1)), ((0,), (0,)))
    got = R.dot_general(a, b, dims, recipe="fp32")
    want = jax.lax.dot_general(a, b, dims, precision="highest")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    ga = jax.grad(lambda a: R.dot_general(a, b, dims, recipe="fp32").sum())(a)
    wa = jax.grad(lambda a: jax.lax.dot_general(a, b, dims, precision="highest").sum())(a)
    np.testing.assert_allclose(np.asarray(ga), np.asarray(wa), rtol=1e-5, atol=1e-5)


def test_nvfp4_hadamard_is_seeded_orthogonal_and_preserves_wgrad():
    h = R.get_recipe("nvfp4").hadamard_matrix()
    np.testing.assert_allclose(h @ h.T, np.eye(16), atol=1e-6)
    syl = np.array([[1.0]])
    for _ in range(4):
        syl = np.kron(np.array([[1, 1], [1, -1]]), syl)
    np.testing.assert_array_equal(np.abs(h) * 4, np.abs(syl))  # signs * H / 4
    np.testing.assert_array_equal(h, R.get_recipe("nvfp4").hadamard_matrix())  # seeded
    assert not np.array_equal(h, R.get_recipe("nvfp4", hadamard_seed=1).hadamard_matrix())
    rng = np.random.default_rng(6)
    x = rng.standard_normal((64, 64)).astype(F32)
    w = rng.standard_normal((64, 32)).astype(F32)
    g = rng.standard_normal((64, 32)).astype(F32)
    errs = {}
    for had in (False, True):
        rec = R.get_recipe("nvfp4", hadamard=had, stochastic_gradients=False)
        _, vjp = jax.vjp(lambda a, b, r=rec: R.matmul(a, b, recipe=r), x, w)
        dw = np.asarray(vjp(jnp.asarray(g))[1], np.float64)
        want = x.astype(np.float64).T @ g
        errs[had] = np.linalg.norm(dw - want) / np.linalg.norm(want)
    assert errs[True] < 0.25 and errs[False] < 0.25  # both close to the exact product


def test_nvfp4_stochastic_gradients_need_a_key_and_use_it():
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((16, 32)).astype(F32))
    w = jnp.asarray(rng.standard_normal((32, 16)).astype(F32))
    c = jnp.asarray(rng.standard_normal((16, 16)).astype(F32))

    def loss(b, k):
        return (R.matmul(x, b, recipe="nvfp4", key=k) * c).sum()

    with pytest.raises(ValueError, match="key"):
        jax.grad(loss)(w, None)
    k0, k1 = jax.random.split(jax.random.key(0))
    g0, g0b, g1 = (np.asarray(jax.grad(loss)(w, k)) for k in (k0, k0, k1))
    np.testing.assert_array_equal(g0, g0b)  # reproducible from the key
    assert not np.array_equal(g0, g1)  # and the key matters


# --- accumulator ---------------------------------------------------------------------------
def _round_frac(v: fractions.Fraction, m: int, mode: str) -> fractions.Fraction:
    if v == 0:
        return v
    sign = -1 if v < 0 else 1
    a = abs(v)
    e = math.floor(math.log2(a))
    while fractions.Fraction(2) ** e > a:
        e -= 1
    while fractions.Fraction(2) ** (e + 1) <= a:
        e += 1
    u = fractions.Fraction(2) ** (e - m)
    q = a / u
    fl = math.floor(q)
    if mode == "toward_zero":
        r = fl
    else:
        rem = q - fl
        r = fl + (
            1
            if rem > fractions.Fraction(1, 2) or (rem == fractions.Fraction(1, 2) and fl % 2)
            else 0
        )
    return sign * r * u


def scalar_accumulate(a, b, m, mode, every):
    s = fractions.Fraction(0)
    f = F32(0)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        p = fractions.Fraction(float(F32(x) * F32(y)))
        s = _round_frac(s + p, m, mode)
        if every and (i + 1) % every == 0:
            f = F32(f + F32(float(s)))
            s = fractions.Fraction(0)
    return float(F32(f + F32(float(s)))) if every else float(s)


@pytest.mark.parametrize("mode", ["nearest_even", "toward_zero"])
@pytest.mark.parametrize("every", [None, 16])
@pytest.mark.parametrize("m", [4, 10, 14])
def test_accumulator_matches_scalar_reference(mode, every, m):
    rng = np.random.default_rng(m)
    k = 100
    a = rng.standard_normal((1, 3, k)).astype(F32).astype(E4M3).astype(F32)
    b = rng.standard_normal((1, 2, k)).astype(F32).astype(E4M3).astype(F32)
    a[0, 2, :] = np.abs(a[0, 2, :])  # a one-signed row: the sum grows, ties get exercised
    got = np.asarray(R.accumulate(jnp.asarray(a), jnp.asarray(b), m, mode, every))
    for i in range(3):
        for j in range(2):
            want = scalar_accumulate(a[0, i], b[0, j], m, mode, every)
            assert float(got[0, i, j]) == want, (i, j, float(got[0, i, j]), want)


def test_accumulator_recipe_field_changes_the_gemm():
    rng = np.random.default_rng(9)
    x = rng.standard_normal((4, 512)).astype(F32)
    w = rng.standard_normal((512, 4)).astype(F32)
    full = np.asarray(R.matmul(x, w, recipe="current"))
    narrow = np.asarray(R.matmul(x, w, recipe=R.get_recipe("current", accumulate_bits=4)))
    assert not np.array_equal(full, narrow)


# --- errors --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: R.get_recipe("fp8"), "unknown recipe 'fp8'; allowed: delayed"),
        (lambda: R.get_recipe("delayed", fp8_format="E5M2"), "E5M2 forward"),
        (lambda: R.get_recipe("mxfp8", scale_rule="round"), "allowed: floor, ceil, rceil, even"),
        (lambda: R.get_recipe("current", accumulate_bits=30), "accumulate_bits"),
        (lambda: R.get_recipe("current", accumulate_rounding="up"), "nearest_even, toward_zero"),
        (lambda: R.get_recipe("current", promote_every=128), "needs accumulate_bits"),
        (lambda: R.get_recipe("mxfp8", blok=3), "no field"),
        (
            lambda: R.matmul(
                jnp.ones((4, 48)), jnp.ones((48, 4)), recipe=R.get_recipe("mxfp8", pad=False)
            ),
            "contraction size 48 is not a multiple of the block size 32; pass "
            r"recipe=get_recipe\(recipe, pad=True\)",
        ),
        (
            lambda: R.matmul(jnp.ones((4, 8), jnp.int32), jnp.ones((8, 4)), recipe="current"),
            "float operands",
        ),
        (lambda: R.matmul(jnp.ones((4, 8)), jnp.ones((8, 4)), recipe="delayed"), "state"),
    ],
)
def test_errors_name_the_allowed_values(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_padding_is_exact_for_blocks():
    rng = np.random.default_rng(10)
    x = rng.standard_normal((4, 48)).astype(F32)
    w = rng.standard_normal((48, 4)).astype(F32)
    got = R.matmul(x, w, recipe=R.get_recipe("mxfp8", pad=True))
    xp = np.pad(x, ((0, 0), (0, 16)))
    wp = np.pad(w, ((0, 16), (0, 0)))
    want = R.matmul(xp, wp, recipe="mxfp8")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("name", ["blockwise", "mxfp8", "mxfp4", "nvfp4"])
def test_matmul_pads_a_named_block_recipe_as_apply_does(name):
    """recipes.matmul by name pads what recipes.apply by name pads (K = 100: no block of 16,
    32 or 128 divides it), bitwise as the zero-padded operands multiply."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((4, 100)).astype(F32)
    w = rng.standard_normal((100, 8)).astype(F32)
    by_name = np.asarray(R.matmul(x, w, recipe=name))
    # weight="rhs" as matmul's default (apply would take the first argument, x, for the
    # parameters and so for the weight)
    applied = np.asarray(R.apply(lambda a, b: a @ b, name, weight="rhs")(x, w))
    np.testing.assert_array_equal(by_name, applied)
    k = -100 % 128
    xp, wp = np.pad(x, ((0, 0), (0, k))), np.pad(w, ((0, k), (0, 0)))
    np.testing.assert_array_equal(by_name, np.asarray(R.matmul(xp, wp, recipe=name)))
    assert not np.array_equal(by_name, x @ w)


def oracle_blockwise_ragged(x, block=128, two_d=False):
    """Blockwise quantize-dequantize of a 2-D (R, K) float32 array whose sizes need not be
    multiples of ``block``: each tile (1 x block, or block x block) is cut short at the edge and
    scaled by its own amax, in float64 (no padding involved)."""
    x64 = x.astype(np.float64)
    out = np.empty_like(x64)
    rows = block if two_d else 1
    for i in range(0, x.shape[0], rows):
        for j in range(0, x.shape[1], block):
            t = x64[i : i + rows, j : j + block]
            s = oracle_block_scale(np.max(np.abs(t)))
            out[i : i + rows, j : j + block] = cast(t * s, "float8_e4m3fn") / s
    return out


def test_blockwise_matmul_pads_to_the_ragged_tile_oracle():
    """K = 300 and N = 136 (no multiple of 128): recipes.matmul by name equals recipes.apply
    bitwise and the float64 blockwise quantization on the unpadded shape (the last tiles cut
    short). Against an identity (exactly representable, one product per output) the product is
    the quantized operand itself, so that comparison is bitwise; the values span 16 decades
    along K, so a tile cut in another place flushes other values to zero."""
    rng = np.random.default_rng(12)
    x = (rng.standard_normal((4, 300)) * np.geomspace(1e-8, 1e8, 300)).astype(F32)
    w = (rng.standard_normal((300, 136)) * np.geomspace(1e-8, 1e8, 300)[:, None]).astype(F32)
    got = np.asarray(R.matmul(x, w, recipe="blockwise"))
    np.testing.assert_array_equal(
        got, np.asarray(R.apply(lambda a, b: a @ b, "blockwise", weight="rhs")(x, w))
    )
    qx = oracle_blockwise_ragged(x)
    qw = oracle_blockwise_ragged(np.ascontiguousarray(w.T), two_d=True).T  # tiles of w as (N, K)
    eye = np.eye(300, dtype=F32)
    np.testing.assert_array_equal(np.asarray(R.matmul(x, eye, recipe="blockwise")), qx)
    np.testing.assert_array_equal(np.asarray(R.matmul(eye, w, recipe="blockwise")), qw)
    assert np.count_nonzero(qx == 0) > 0 and not np.array_equal(qx, x)  # flushed and rounded
    want = qx @ qw
    _close(got, want, 300 * 2.0**-23 * (np.abs(qx) @ np.abs(qw)) + 1e-30)
