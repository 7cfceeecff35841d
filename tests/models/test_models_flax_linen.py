"""Every feature on a Flax Linen model: the CNN of Flax's MNIST example (``nn.Module`` with
``@nn.compact``, ``nn.Conv``, ``nn.avg_pool``, ``nn.Dense``), trained with
``flax.training.train_state.TrainState``; shrunk to 8x8 images. See tests/_model_features.py.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from _model_features import Subject, covers, params
from flax.training import train_state

from precisionlab import recipes

BATCH, SIDE, CLASSES = 4, 8, 10


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(features=4, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))  # flatten
        x = nn.Dense(features=16)(x)
        x = nn.relu(x)
        x = nn.Dense(features=CLASSES)(x)
        return x


def criterion(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@pytest.fixture(scope="module")
def batch() -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (BATCH, SIDE, SIDE, 1))
    return x, jax.random.randint(ky, (BATCH,), 0, CLASSES)


@pytest.fixture(scope="module")
def subject(batch) -> Subject:
    cnn = CNN()
    variables = jax.jit(cnn.init)(jax.random.key(0), jnp.ones((1, SIDE, SIDE, 1)))

    def apply(params, x):
        return cnn.apply({"params": params}, x)

    weights = ("Conv_0/kernel", "Dense_0/kernel", "Dense_1/kernel")
    return Subject("flax_linen", variables["params"], *batch, apply, criterion, weights=weights)


@covers("matmuls", "conv")
def test_train_state_steps_with_a_recipe(subject, batch):
    """Flax's train_step (jax.value_and_grad of the loss of state.apply_fn, then
    state.apply_gradients) with the loss's matmuls in FP8 (current scaling): the loss differs
    from the float32 one and falls."""
    state = train_state.TrainState.create(
        apply_fn=CNN().apply, params=subject.params, tx=optax.adam(1e-2)
    )

    def loss_fn(params, x, y):
        return criterion(state.apply_fn({"params": params}, x), y)

    fp8_loss = recipes.apply(loss_fn, "current")

    @jax.jit
    def train_step(state, x, y):
        loss, grads = jax.value_and_grad(fp8_loss)(state.params, x, y)
        return state.apply_gradients(grads=grads), loss

    losses = []
    for _ in range(3):
        state, loss = train_step(state, *batch)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    float32 = float(criterion(subject.out32, subject.y))
    assert losses[0] != float32 and abs(losses[0] - float32) < 0.1 * float32


DEFAULT = {"observe", "audit", "include_by_regex"}


@pytest.mark.parametrize("feature", params(DEFAULT))
def test_feature(subject, feature):
    feature.check(subject)
