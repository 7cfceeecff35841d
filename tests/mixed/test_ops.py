"""Forced numerics at op boundaries and the float32-list ops, against numpy/ml_dtypes references."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from precisionlab.mixed import enforce, get_policy, ops

RNG = np.random.default_rng(0)


def _samples(n=4096):
    # Magnitudes from 2**-30 to 2**20: subnormals of fp16, normals, overflow.
    mag = 2.0 ** RNG.uniform(-30, 20, n)
    return (mag * RNG.choice([-1.0, 1.0], n)).astype(np.float32)


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float8_e5m2", "float8_e4m3fn"])
def test_enforce_equals_ml_dtypes_cast(name):
    x = _samples()
    with np.errstate(over="ignore"):  # overflow to inf is part of what is compared
        ref = x.astype(
            getattr(ml_dtypes, name)
            if name.startswith("float8") or name == "bfloat16"
            else np.float16
        ).astype(np.float32)
    got = np.asarray(jax.jit(lambda v: enforce(v, name))(jnp.asarray(x)))
    if jax.default_backend() == "cpu" and name == "bfloat16":
        # XLA on CPU flushes float32 subnormals (bf16's subnormals are float32 subnormals).
        keep = np.abs(ref) >= np.finfo(np.float32).tiny
        got, ref = got[keep], ref[keep]
    np.testing.assert_array_equal(got, ref)


def test_fp16_activation_above_max_becomes_inf():
    p = get_policy("p=f32,c=f16,o=f32")
    x = jnp.asarray([[300.0, 1.0]], jnp.float32)
    w = jnp.asarray([[300.0], [0.0]], jnp.float32)  # 300 * 300 = 90000 > 65504
    f = jax.jit(lambda x, w: ops.dense(x, w, policy=p) * jnp.float16(0.001))
    out = np.asarray(f(x, w))
    assert out.dtype == np.float16 and np.isinf(out).all()
    # Just below the largest float16 value (65504) stays finite.
    w2 = jnp.asarray([[218.0], [0.0]], jnp.float32)  # 65400
    assert np.isfinite(np.asarray(f(x, w2))).all()
    # The same through the models' elementwise path.
    y = jax.jit(lambda v: ops.boundary(v * 2.0, p))(jnp.asarray([40000.0]))
    assert np.isinf(np.asarray(y)).all()


@pytest.mark.parametrize(
    ("cot", "expect"),
    [
        (2.0**-26, 0.0),  # below half the smallest float16 subnormal: lost
        (2.0**-20, 2.0**-20),  # a float16 subnormal: kept, as on a GPU
        (3.0 * 2.0**-24 + 2.0**-30, 3.0 * 2.0**-24),  # rounded to the subnormal grid
        (1.0 + 2.0**-12, 1.0),  # normal range: 10 mantissa bits
        (1e5, np.inf),  # overflow
    ],
)
def test_enforce_rounds_the_cotangent(cot, expect):
    def f(x):
        return jnp.sum(enforce(x, jnp.float16) * jnp.float32(cot))

    g = jax.grad(f)(jnp.ones(2, jnp.float32))
    # The cotangent reaching enforce is cot (float32); it is rounded to float16's grid.
    np.testing.assert_array_equal(np.asarray(g), np.full(2, expect, np.float32))


def test_bf16_matmul_rounds_once_like_reference():
    a = RNG.normal(size=(32, 48)).astype(np.float32)
    b = RNG.normal(size=(48, 16)).astype(np.float32)
    p = get_policy("p=f32,c=bf16,o=f32")
    got = np.asarray(jax.jit(lambda a, b: ops.matmul(a, b, policy=p))(a, b)).astype(np.float64)
    a16 = a.astype(ml_dtypes.bfloat16).astype(np.float64)
    b16 = b.astype(ml_dtypes.bfloat16).astype(np.float64)
    ref = (a16 @ b16).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    # float32 accumulation may differ from float64 by one float32 ulp, which can flip a bf16 tie.
    ulp = np.abs(ref) * 2.0**-7
    assert np.all(np.abs(got - ref) <= ulp)
    assert np.mean(got == ref) > 0.98


def _np_softmax(x):
    x = x - x.max(-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("policy", ["p=f32,c=f32,o=f32", "p=f32,c=bf16,o=f32", "c=f16"])
def test_softmax_layer_norm_cross_entropy(policy):
    p = get_policy(policy)
    tol = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}[p.compute_dtype.name]
    x = RNG.normal(size=(8, 10)).astype(np.float32) * 3
    labels = RNG.integers(0, 10, 8)
    x64 = x.astype(np.float64)
    sm = ops.softmax(x, policy=p)
    assert sm.dtype == p.compute_dtype
    np.testing.assert_allclose(np.asarray(sm, np.float64), _np_softmax(x64), atol=tol)
    ln = ops.layer_norm(x, policy=p)
    ref = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
    assert ln.dtype == p.compute_dtype
    np.testing.assert_allclose(np.asarray(ln, np.float64), ref, atol=4 * tol)
    ce = ops.cross_entropy(x, labels, policy=p)
    assert ce.dtype == np.float32  # kept in float32 by default: it is the loss
    ref_ce = -np.mean(np.log(_np_softmax(x64))[np.arange(8), labels])
    np.testing.assert_allclose(float(ce), ref_ce, rtol=1e-5)


def test_ops_outside_fp32_list_run_in_compute_dtype():
    p = get_policy("c=f16", fp32_ops=[])
    x = jnp.asarray([[12.0, 0.0]], jnp.float32)
    assert ops.cross_entropy(x, jnp.asarray([1]), policy=p).dtype == jnp.float16
    assert ops.reduce_sum(jnp.full((4,), 30000.0), policy=p).dtype == jnp.float16
    # 4 * 30000 overflows float16 when the reduction is not kept in float32 ...
    assert np.isinf(float(ops.reduce_sum(jnp.full((4,), 30000.0), policy=p)))
    # ... and is exact (then rounded once, 120000 > 65504 -> inf) when it is: use a mean.
    q = get_policy("c=f16")
    assert float(ops.reduce_mean(jnp.full((4,), 30000.0), policy=q)) == 30000.0
