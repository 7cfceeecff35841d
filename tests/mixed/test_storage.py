"""Storage precision: update rounding (nearest, stochastic, Kahan) and optimizer-state dtypes."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from precisionlab.mixed import (
    ScaledArray,
    Storage,
    apply_updates,
    init_storage_state,
    round_to_storage,
    store_opt_state,
)
from precisionlab.mixed._storage import compress, decompress

BF16_ULP_AT_1 = 2.0**-7


def _run(update, steps, p0, u, key=0):
    params = {"w": jnp.full((4096,), p0, jnp.bfloat16)}
    ups = {"w": jnp.full((4096,), u, jnp.float32)}
    state = init_storage_state(params, update)

    @jax.jit
    def body(i, carry):
        p, s = carry
        return apply_updates(
            p, ups, s, update=update, key=jax.random.fold_in(jax.random.PRNGKey(key), i)
        )

    return np.asarray(jax.lax.fori_loop(0, steps, body, (params, state))[0]["w"]).astype(np.float64)


def test_nearest_loses_small_updates():
    w = np.asarray(_run("nearest", 64, 1.0, 2.0**-10))
    assert np.all(w == 1.0)  # each update is 1/8 ulp: rounded away every time


def test_stochastic_rounding_is_unbiased():
    u, steps = 2.0**-10, 64
    w = np.asarray(_run("stochastic", steps, 1.0, u))
    exact = 1.0 + steps * u  # float64 reference
    # Each element is a sum of independent unbiased roundings: the mean over 4096 elements is
    # within a few standard errors of the exact sum (per-step variance <= ulp**2 / 4).
    se = np.sqrt(steps) * BF16_ULP_AT_1 / 2 / np.sqrt(w.size)
    assert abs(w.mean() - exact) < 5 * se
    assert np.unique(w).size > 1  # different elements took different roundings


def test_single_stochastic_rounding_probability():
    x = jnp.full((20000,), 1.0 + 2.0**-9, jnp.float32)  # 1/4 of the way to the next bf16
    r = np.asarray(
        round_to_storage(x, jnp.bfloat16, rounding="stochastic", key=jax.random.PRNGKey(3))
    ).astype(np.float64)
    assert set(np.unique(r).tolist()) == {1.0, 1.0 + BF16_ULP_AT_1}
    frac_up = np.mean(r > 1.0)
    assert abs(frac_up - 0.25) < 5 * np.sqrt(0.25 * 0.75 / r.size)


def test_kahan_keeps_small_updates():
    u, steps = 2.0**-10, 256
    exact = 1.0 + steps * u  # 1.25, float64
    w = np.asarray(_run("kahan", steps, 1.0, u))
    assert np.all(np.abs(w - exact) <= 2.0**-7)
    assert np.all(np.asarray(_run("nearest", steps, 1.0, u)) == 1.0)


def test_float32_params_ignore_mode():
    p = {"w": jnp.asarray([1.0, 2.0], jnp.float32)}
    u = {"w": jnp.asarray([2.0**-30, -0.5], jnp.float32)}
    for mode in ("nearest", "stochastic", "kahan"):
        new, _ = apply_updates(
            p, u, init_storage_state(p, mode), update=mode, key=jax.random.PRNGKey(0)
        )
        np.testing.assert_array_equal(
            new["w"], np.float32([1.0, 2.0]) + np.float32([2.0**-30, -0.5])
        )


def test_stochastic_needs_key():
    p = {"w": jnp.ones(2, jnp.bfloat16)}
    with pytest.raises(ValueError, match="PRNG key"):
        apply_updates(p, p, init_storage_state(p, "stochastic"), update="stochastic")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_opt_state_stored_in_dtype(dtype):
    params = {"w": jnp.linspace(-1, 1, 64, dtype=jnp.float32).reshape(8, 8)}
    grads = {"w": 1.0 + 0.5 * jnp.cos(params["w"] * 3)}
    ref_tx, tx = optax.adam(1e-2), store_opt_state(optax.adam(1e-2), dtype)
    s_ref, s = ref_tx.init(params), tx.init(params)
    floats = [x for x in jax.tree_util.tree_leaves(s) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and all(x.dtype == np.dtype(dtype) for x in floats)
    for _ in range(3):
        u_ref, s_ref = ref_tx.update(grads, s_ref, params)
        u, s = tx.update(grads, s, params)
    assert jax.tree_util.tree_leaves(s)[0].dtype == np.int32  # adam's count untouched
    np.testing.assert_allclose(u["w"], u_ref["w"], rtol=2e-2, atol=1e-5)


@pytest.mark.parametrize(("dtype", "rel"), [("float8_e4m3fn", 2.0**-4), ("float8_e5m2", 2.0**-3)])
def test_fp8_state_with_scale(dtype, rel):
    x = {"m": jnp.asarray(np.random.default_rng(0).normal(size=(256,)) * 1e-3, jnp.float32)}
    c = compress(x, dtype)
    assert isinstance(c["m"], ScaledArray) and c["m"].values.dtype == np.dtype(dtype)
    back = np.asarray(decompress(c)["m"], np.float64)
    ref = np.asarray(x["m"], np.float64)
    scale = float(c["m"].scale)
    # Reference: ml_dtypes' cast of the scaled value (round to nearest even).
    expect = (ref / scale).astype(getattr(ml_dtypes, dtype)).astype(np.float64) * scale
    np.testing.assert_allclose(back, expect, rtol=1e-6)
    big = np.abs(ref) > np.abs(ref).max() * 2.0**-6
    assert np.all(np.abs(back - ref)[big] <= rel * np.abs(ref)[big])
    tx = store_opt_state(optax.adam(1e-3), dtype)
    p = {"w": jnp.ones((4, 4))}
    u, _ = jax.jit(tx.update)({"w": jnp.full((4, 4), 0.1)}, tx.init(p), p)
    assert np.all(np.isfinite(np.asarray(u["w"])))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"update": "round"}, "unknown update rounding"),
        ({"opt_state": "int8"}, "unknown dtype"),
        ({"grads": "float12"}, "unknown dtype"),
        ({"params": "half"}, "ambiguous"),
    ],
)
def test_storage_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        Storage(**kw)


def test_low_precision_state_keeps_scalar_hyperparameters_exact():
    """inject_hyperparams keeps the learning rate in the state: it must not be rounded."""
    opt = store_opt_state(optax.inject_hyperparams(optax.adam)(learning_rate=3e-4), "bfloat16")
    params = {"w": jnp.ones((4, 4), jnp.float32)}
    state = opt.init(params)
    lr = [x for x in jax.tree_util.tree_leaves(state) if jnp.ndim(x) == 0 and x.dtype.kind == "f"]
    assert lr and all(x.dtype == jnp.float32 for x in lr)
    assert any(float(x) == np.float32(3e-4) for x in lr)
    moments = [x for x in jax.tree_util.tree_leaves(state) if jnp.ndim(x) == 2]
    assert moments and all(x.dtype == jnp.bfloat16 for x in moments)


@pytest.mark.parametrize("n", [64, 1 << 16])  # small, and large enough for XLA's CPU NaN bug
def test_fp8_scale_ignores_nonfinite_at_any_size(n):
    x = np.linspace(-3.0, 3.0, n, dtype=np.float32)
    x[1], x[2] = np.nan, np.inf
    (s,) = jax.tree_util.tree_leaves(jax.jit(lambda t: compress(t, "float8_e4m3fn"))([x]))[1:]
    finite = np.abs(x[np.isfinite(x)]).max()
    # (XLA may divide by the constant through its reciprocal: one float32 ulp)
    np.testing.assert_allclose(float(s), finite / 448.0, rtol=2**-23)
