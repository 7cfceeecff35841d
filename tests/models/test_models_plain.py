"""Every feature on a plain-JAX model: a dict of arrays, the layers stacked and run by
``lax.scan`` under ``jax.checkpoint`` (remat), written per example and batched with
``jax.vmap``, as JAX's own tutorials write one (see tests/_model_features.py)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
import pytest
from _model_features import Subject, params

D_IN, WIDTH, LAYERS, CLASSES, BATCH = 8, 16, 2, 10, 8


def init(key: jax.Array) -> dict:
    k_in, k_w, k_out, k_f = jax.random.split(key, 4)
    return {
        "smooth": jax.random.normal(k_f, (3,)) / 2,
        "embed": jax.random.normal(k_in, (D_IN, WIDTH)) / math.sqrt(D_IN),
        "layers": {  # stacked: one leading axis over the layers, for lax.scan
            "w": jax.random.normal(k_w, (LAYERS, WIDTH, WIDTH)) / math.sqrt(WIDTH),
            "b": jnp.zeros((LAYERS, WIDTH)),
        },
        "head": jax.random.normal(k_out, (WIDTH, CLASSES)) / math.sqrt(WIDTH),
    }


def forward(params: dict, x: jax.Array) -> jax.Array:
    """One example (D_IN,) -> logits (CLASSES,)."""
    x = x + jnp.convolve(x, params["smooth"], mode="same")  # a 1-D filter over the features
    h = jnp.tanh(x @ params["embed"])

    @jax.checkpoint  # recompute each layer's activations in the backward pass
    def layer(h, p):
        return h + jax.nn.gelu(h @ p["w"] + p["b"]), None

    h, _ = jax.lax.scan(layer, h, params["layers"])
    return h @ params["head"]


def apply(params: dict, x: jax.Array) -> jax.Array:
    return jax.vmap(forward, in_axes=(None, 0))(params, x)


def criterion(logits: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@pytest.fixture(scope="module")
def subject() -> Subject:
    """Eight examples of a 10-class problem (the loss of random logits, about ln 10, is > 1)."""
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (BATCH, D_IN))
    y = jax.random.randint(ky, (BATCH,), 0, CLASSES)
    weights = ("smooth", "embed", "layers/w", "head")
    return Subject("plain", init(jax.random.key(0)), x, y, apply, criterion, weights=weights)


def test_the_model_is_what_it_claims(subject):
    """scan over the stacked layers, remat inside, vmap outside: the matmuls inside the scan
    run once per layer (read from the traced program)."""
    jaxpr = str(jax.make_jaxpr(apply)(subject.params, subject.x))
    assert "scan[" in jaxpr and ("checkpoint[" in jaxpr or "remat" in jaxpr)
    assert len(subject.dots) == 3  # embed, the scanned layer's, head


DEFAULT = {
    "policy_casts", "dynamic_loss_scale_overflow", "recipe_current", "recipe_delayed_training",
    "include_exclude_by_path",
}  # fmt: skip


@pytest.mark.parametrize("feature", params(DEFAULT))
def test_feature(subject, feature):
    feature.check(subject)
