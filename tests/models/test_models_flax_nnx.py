"""Every feature on a Flax NNX model: a one-block transformer language model written as the
Flax NNX tutorials write one (``nnx.Embed``, ``nnx.MultiHeadAttention`` with a causal mask,
``nnx.LayerNorm``, ``nnx.Linear``, modules built with ``dtype=`` for mixed precision), trained
with ``nnx.Optimizer`` and optax adamw under ``nnx.jit`` / ``nnx.value_and_grad``.

The shared checks (tests/_model_features.py) see it in NNX's functional form (``nnx.split``
into a graph definition and a ``State``, ``nnx.merge`` to call it); the NNX-native ones pass
the module itself through precisionlab's wrappers.
"""

from __future__ import annotations

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import optax
import pytest
from _model_features import Subject, covers, matmuls, params

from precisionlab import recipes, telemetry
from precisionlab.mixed import get_policy

VOCAB, WIDTH, HEADS, BATCH, LENGTH = 11, 8, 2, 2, 7


def attention(query, key, value, mask=None, **_):
    """Softmax attention in the operands' dtype. (nnx.MultiHeadAttention's default,
    jax.nn.dot_product_attention, accumulates float16 products in float32, which XLA:CPU's
    dot_general refuses: the float16 checks could not run on this CPU.)"""
    logits = jnp.einsum("...qhd,...khd->...hqk", query, key) * query.shape[-1] ** -0.5
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    return jnp.einsum("...hqk,...khd->...qhd", nnx.softmax(logits, axis=-1), value)


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, *, rngs: nnx.Rngs, dtype=None):
        # a causal token-mixing convolution over the sequence (as H3 and Mamba blocks have)
        self.conv = nnx.Conv(d, d, kernel_size=(3,), padding="CAUSAL", dtype=dtype, rngs=rngs)
        self.ln1 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=heads, in_features=d, decode=False, dtype=dtype, rngs=rngs,
            attention_fn=attention,
        )  # fmt: skip
        self.ln2 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.conv(x)
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class LM(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, dtype=None):
        self.embed = nnx.Embed(VOCAB, WIDTH, dtype=dtype, rngs=rngs)
        self.block = Block(WIDTH, HEADS, dtype=dtype, rngs=rngs)
        self.ln = nnx.LayerNorm(WIDTH, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(WIDTH, VOCAB, dtype=dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        mask = nnx.make_causal_mask(tokens)
        return self.head(self.ln(self.block(self.embed(tokens), mask)))


def criterion(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def loss_fn(model: LM, tokens: jax.Array) -> jax.Array:
    return criterion(model(tokens[:, :-1]), tokens[:, 1:])


def functional(dtype=None) -> tuple[nnx.GraphDef, nnx.State]:
    return nnx.split(LM(rngs=nnx.Rngs(0), dtype=dtype))


@pytest.fixture(scope="module")
def tokens() -> jax.Array:
    return jax.random.randint(jax.random.key(1), (BATCH, LENGTH), 0, VOCAB)


@pytest.fixture(scope="module")
def subject(tokens) -> Subject:
    graphdef, state = functional()

    def apply(state, x):
        return nnx.merge(graphdef, state)(x)

    def compute(policy):
        """NNX's mixed precision: modules built with dtype=compute (params stay float32)."""
        g, s = functional(get_policy(policy).compute_dtype)
        return s, lambda state, x: nnx.merge(g, state)(x)

    x, y = tokens[:, :-1], tokens[:, 1:]
    weights = (
        "block/conv/kernel",
        *(f"block/attn/{p}/kernel" for p in ("query", "key", "value", "out")),
        "block/up/kernel", "block/down/kernel", "head/kernel",
    )  # fmt: skip
    return Subject("flax_nnx", state, x, y, apply, criterion, compute=compute,
                   weights=weights, products=2)  # fmt: skip


def test_casting_params_alone_leaves_nnx_in_float32(subject):
    """The pitfall the guide warns about: nnx.Embed fixes its dtype (float32) when built, so a
    jmp-style cast of the params to bfloat16 leaves every matmul computing in float32 (each
    promotes back). The compute-dtype audit (issue 33, item 3) is to warn here."""
    cast = get_policy("p=f32,c=bf16,o=f32").cast_to_compute(subject.params)
    dtypes = {(str(a.dtype), str(b.dtype)) for a, b in matmuls(subject.apply, cast, subject.x)}
    assert ("float32", "float32") in dtypes


@covers("matmuls", "by_path")
def test_nnx_value_and_grad_takes_the_recipe(subject, tokens):
    """nnx.value_and_grad over recipes.apply(loss_fn) inside nnx.jit, on the module itself:
    a State of gradients for every Param, and an FP8 loss that differs from the float32 one
    by a quantization-sized amount. (The head alone is quantized, include=[-1]: nine FP8
    matmuls cost seconds of compile time; the shared table quantizes them all.)"""
    model = LM(rngs=nnx.Rngs(0))
    fp8_loss = recipes.apply(loss_fn, "current", include=[-1])
    loss, grads = nnx.jit(nnx.value_and_grad(fp8_loss))(model, tokens)
    assert isinstance(grads, nnx.State)
    n_params = len(jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert len(jax.tree.leaves(grads)) == n_params
    float32 = float(criterion(subject.out32, subject.y))
    assert float(loss) != float32 and abs(float(loss) - float32) < 0.1 * float32


@pytest.mark.slow
@covers("matmuls", "conv")
def test_nnx_training_with_a_recipe(tokens):
    """nnx.jit + nnx.value_and_grad over recipes.apply(loss_fn), nnx.Optimizer with adamw:
    the FP8 loss falls."""
    model = LM(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    fp8_loss = recipes.apply(loss_fn, "current")

    @nnx.jit
    def train_step(model, optimizer, tokens):
        loss, grads = nnx.value_and_grad(fp8_loss)(model, tokens)
        optimizer.update(model, grads)
        return loss

    losses = [float(train_step(model, optimizer, tokens)) for _ in range(3)]
    assert losses[-1] < losses[0]


@pytest.mark.slow
@covers("observe")
def test_nnx_step_observes_the_module(tokens):
    """observe inside an nnx.jit step, on the module itself: statistics of all 9 matmuls
    (4 attention projections, 2 attention products, 2 MLP, the head) and the convolution, the
    loss bitwise the unobserved one."""
    model = LM(rngs=nnx.Rngs(0))
    observed = telemetry.observe(loss_fn)
    loss, stats = nnx.jit(observed)(model, tokens)
    assert float(loss) == float(nnx.jit(loss_fn)(model, tokens))
    assert len(stats) == 10
    assert all(float(s["out"].amax) > 0 for s in stats.values())


DEFAULT = {"policy_casts", "site_names", "unknown_names_raise"}


@pytest.mark.parametrize("feature", params(DEFAULT))
def test_feature(subject, feature):
    feature.check(subject)
