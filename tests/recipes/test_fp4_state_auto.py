"""Stateful FP4 recipes (TetraJet's Q-EMA) under ``recipes.apply``'s default ``weight="auto"``:
the per-matmul state is shaped like the weight operand the dataflow finds, also when the weight
is the lhs (``w @ x``, Equinox's layout). Found while typing ``recipes._apply``: the state was made
for the rhs whatever the site's roles, so a ``w @ x`` run failed on a shape mismatch (or, for
square operands, averaged the activation as if it were the weight)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab import recipes as R

W = jax.random.normal(jax.random.key(0), (32, 64), jnp.float32)  # w @ x: the weight is the lhs
X = jax.random.normal(jax.random.key(1), (64, 96), jnp.float32)


def _loss(w: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.sum((w @ x) ** 2)


def test_auto_weight_state_is_the_lhs_weights_and_matches_weight_lhs():
    recipe = R.get_recipe("tetrajet")
    auto, lhs = R.apply(_loss, recipe), R.apply(_loss, recipe, weight="lhs")
    st = auto.init_state(W, X)
    assert [s.roles for s in auto.sites(W, X)] == [("w", "x")]
    assert {k: v["ema"].shape for k, v in st.items()} == {"dot_general[0]": W.shape}
    key = jax.random.key(2)
    got = auto.value_and_grad(0)(st, W, X, key=key)
    want = lhs.value_and_grad(0)(lhs.init_state(W, X), W, X, key=key)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the observation is the weight's EMA: rolled into the state as the lhs-weight run's
    new = auto.update_state(st, got[2])
    assert new["dot_general[0]"]["ema"].shape == W.shape
