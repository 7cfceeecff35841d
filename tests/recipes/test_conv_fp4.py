"""A convolution under an FP4 recipe is the recipe's own three GEMMs on the patch matrix, as a
matmul under it is. Before, ``recipes.conv_general_dilated`` knew no FP4 recipe name, and under
``apply`` a convolution ran the generic block-quantized GEMMs instead of the recipe's (no
rotation, no stochastic rounding of its choosing, no state): silently another recipe.

Oracle: the patch matrix written out by hand for a 1-D convolution (window taps, then input
channels fastest) and multiplied by ``recipes.dot_general`` under the same recipe and key."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from precisionlab.recipes import apply, conv_general_dilated, dot_general

DN = ("NWC", "WIO", "NWC")
TAPS = 3


def _inputs():
    x = jax.random.normal(jax.random.key(0), (2, 10, 16), jnp.float32)  # N, W, C
    k = jax.random.normal(jax.random.key(1), (TAPS, 16, 32), jnp.float32) * 0.2  # W, I, O
    return x, k


def _conv(x, k, recipe, key):
    y = conv_general_dilated(x, k, (1,), "VALID", dimension_numbers=DN, recipe=recipe, key=key)
    return y


def _by_hand(x, k, recipe, key):
    n, w, c = x.shape
    p = w - TAPS + 1
    patches = jnp.stack([x[:, i : i + TAPS, :].reshape(n, TAPS * c) for i in range(p)], axis=1)
    rows = k.reshape(TAPS * c, -1).T  # (O, K): output features by (taps, channels)
    dn = (((1,), (1,)), ((), ()))
    y = dot_general(patches.reshape(n * p, TAPS * c), rows, dn, recipe=recipe, key=key)
    return y.reshape(n, p, -1)


@pytest.mark.parametrize("recipe", [pytest.param("nvidia_fp4", marks=pytest.mark.slow), "quartet"])
def test_the_convolution_is_the_recipes_gemm_on_the_patches(recipe):
    x, k = _inputs()
    key = jax.random.key(2)

    def loss(f):
        return lambda x, k: jnp.sum(f(x, k, recipe, key) * jnp.arange(32.0))

    y, want = _conv(x, k, recipe, key), _by_hand(x, k, recipe, key)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    assert not np.array_equal(np.asarray(y), np.asarray(_conv(x, k, "fp32", None)))
    (gx, gk), (hx, hk) = jax.grad(loss(_conv), (0, 1))(x, k), jax.grad(loss(_by_hand), (0, 1))(x, k)
    np.testing.assert_array_equal(np.asarray(gk), np.asarray(hk))
    # the data gradient sums each input's windows: the same float32 terms, maybe in another order
    np.testing.assert_allclose(np.asarray(gx), np.asarray(hx), rtol=1e-6, atol=1e-6)


def test_apply_runs_the_recipes_gemms_on_a_convolution():
    x, k = _inputs()
    key = jax.random.key(3)

    def conv(x, k):
        return jax.lax.conv_general_dilated(x, k, (1,), "VALID", dimension_numbers=DN)

    # the key apply gives its one convolution (k the parameter: the weight, as by hand): site 0,
    # then the primitive's name folded in
    site_key = jax.random.fold_in(jax.random.fold_in(key, 0), zlib.crc32(b"conv_general_dilated"))
    weights = jnp.arange(32.0)

    def applied(x, k):
        return jnp.sum(apply(conv, "quartet", params=1)(x, k, key=key) * weights)

    def by_hand(x, k):
        return jnp.sum(_by_hand(x, k, "quartet", site_key) * weights)

    # the backward GEMMs are where the generic block GEMMs and Quartet's own part
    (gx, gk), (hx, hk) = jax.grad(applied, (0, 1))(x, k), jax.grad(by_hand, (0, 1))(x, k)
    np.testing.assert_array_equal(np.asarray(gk), np.asarray(hk))
    np.testing.assert_allclose(np.asarray(gx), np.asarray(hx), rtol=1e-6, atol=1e-6)
