"""A recipe applied by name to a model with a ten-class output, under grad."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from precisionlab import recipes


# --- recipes.apply pads like training ------------------------------------------------------
def test_apply_by_name_pads_a_ten_class_output_under_grad():
    """Forward and backward GEMMs of a 10-class head (the data gradient contracts over 10, not a
    multiple of MX's 32-element block): a recipe named to apply pads, as training pads; a
    Recipe object keeps what it says (pad=False refuses, naming pad=True)."""

    def mlp(p, x):
        return jnp.tanh(x @ p["w1"]) @ p["w2"]

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    p = {"w1": jax.random.normal(k1, (32, 32)), "w2": jax.random.normal(k2, (32, 10))}
    x = jax.random.normal(k3, (32, 32))
    by_name = recipes.apply(mlp, "mxfp8")
    assert by_name.recipe == recipes.get_recipe("mxfp8", pad=True)
    g = jax.jit(jax.grad(lambda q: by_name(q, x).sum()))(p)
    assert all(bool(jnp.isfinite(v).all()) and v.shape == p[k].shape for k, v in g.items())
    strict = recipes.apply(mlp, recipes.get_recipe("mxfp8", pad=False))
    with pytest.raises(ValueError, match="pad=True"):
        jax.eval_shape(jax.grad(lambda q: strict(q, x).sum()), p)  # raised while tracing
    assert recipes.apply(mlp, "current").recipe == recipes.get_recipe("current")  # no pad field
