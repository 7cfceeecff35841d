"""Models written as their libraries' own docs write them (no precisionlab code inside), for
the tests of site names, attention selection and the compute-dtype audit.

- :class:`MiniLM`: a Flax NNX decoder (``nnx.Embed``, ``nnx.MultiHeadAttention``,
  ``nnx.LayerNorm``, ``nnx.Linear``), dtypes left at their defaults, as the NNX guides write
  a transformer (``param_dtype``/``dtype`` not given);
- :func:`plain_model`: a plain pytree MLP with its hidden layers stacked under ``lax.scan``
  and ``jax.checkpoint``;
- :class:`EqxMLP`: Equinox's ``eqx.nn.MLP`` (``w @ x`` per example, under ``vmap``).
"""

from __future__ import annotations

import equinox as eqx
import flax.nnx as nnx
import jax
import jax.numpy as jnp

VOCAB, D, SEQ = 32, 16, 8


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, *, rngs: nnx.Rngs, dtype=None):
        self.ln1 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=heads, in_features=d, decode=False, dtype=dtype, rngs=rngs
        )
        self.ln2 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
        self.fc1 = nnx.Linear(d, 4 * d, dtype=dtype, rngs=rngs)
        self.fc2 = nnx.Linear(4 * d, d, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        mask = nnx.make_causal_mask(x[..., 0])
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))


class MiniLM(nnx.Module):
    """``dtype`` None (the docs' default): every module computes in its parameters' dtype
    as fixed at construction; ``jnp.bfloat16``: NNX's own mixed precision."""

    def __init__(self, *, rngs: nnx.Rngs, depth: int = 2, dtype=None):
        self.embed = nnx.Embed(VOCAB, D, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([Block(D, 2, dtype=dtype, rngs=rngs) for _ in range(depth)])
        self.ln_f = nnx.LayerNorm(D, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, dtype=dtype, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))


def nnx_lm(seed: int = 0, dtype=None, depth: int = 2):
    """(graphdef, state, tokens): ``nnx.merge(graphdef, state)(tokens)`` is the model."""
    model = MiniLM(rngs=nnx.Rngs(seed), dtype=dtype, depth=depth)
    graphdef, state = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(seed + 1), (2, SEQ), 0, VOCAB)
    return graphdef, state, tokens


def plain_params(seed: int = 0, depth: int = 3, width: int = 32):
    k = jax.random.split(jax.random.key(seed), 3)
    return {
        "w_in": jax.random.normal(k[0], (8, width)) / 3,
        "hidden": {"w": jax.random.normal(k[1], (depth, width, width)) / width**0.5},
        "w_out": jax.random.normal(k[2], (width, 4)) / width**0.5,
    }


def plain_model(params, x):
    h = jnp.tanh(x @ params["w_in"])

    @jax.checkpoint
    def layer(h, w):
        return jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(layer, h, params["hidden"]["w"])
    return h @ params["w_out"]


def eqx_mlp(seed: int = 0):
    """(params, static, x) of ``eqx.nn.MLP(8, 4, 32, depth=2)`` and a batch of 16."""
    mlp = eqx.nn.MLP(8, 4, 32, depth=2, key=jax.random.key(seed))
    params, static = eqx.partition(mlp, eqx.is_array)
    x = jax.random.normal(jax.random.key(seed + 1), (16, 8))
    return params, static, x
