"""A small train step in plain JAX + optax whose memory the estimator can predict: the one
the ``[memory]`` experiment measures.

:func:`stack_step`: a stack of ``n_layers`` residual blocks ``x + tanh(x W1) W2`` on a
``batch x d_model`` activation, its layers run by ``lax.scan``; optional activation
checkpointing every K blocks (``jax.checkpoint`` around a scan over K blocks) and gradient
accumulation over micro-batches. :class:`BuiltStep` holds it (the tests build more steps with
it). It follows a mixed-precision policy: params stored in ``param_dtype``, cast to
``compute_dtype`` for the forward and backward pass, loss in float32. The step is
``step(params, opt_state, batch) -> (params, opt_state, loss)`` with params and optimizer state
donated.

Why a scan: on the CPU backend XLA (up to jax 0.10; 0.11.2 keeps them) removes the optimization
barriers that ``jax.checkpoint`` puts around unrolled layers and common-subexpression
elimination then undoes the rematerialisation (no memory saved, no extra FLOPs); a checkpointed
scan body cannot be merged with the forward pass, so the saving is real on every backend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from precisionlab.mixed import Policy, get_policy

__all__ = ["BuiltStep", "make_optimizer", "stack_step"]


@dataclasses.dataclass(frozen=True)
class BuiltStep:
    """A train step and what it runs on.

    Attributes:
      step: ``step(params, opt_state, batch) -> (params, opt_state, loss)``, not yet jitted.
      params, opt_state, batch: its arguments.
      activation_bytes: bytes of activations the model saves for the backward pass (one
        micro-batch), counted from its structure, for :func:`estimate_step`.
      description: one line.
    """

    step: Callable[..., Any]
    params: Any
    opt_state: Any
    batch: Any
    activation_bytes: int
    description: str

    @property
    def args(self) -> tuple[Any, Any, Any]:
        return (self.params, self.opt_state, self.batch)

    @classmethod
    def of(
        cls,
        loss_fn: Callable[[Any, Any], jax.Array],
        params: Any,
        batch: Any,
        policy: Policy,
        optimizer: str,
        microbatches: int,
        activation_bytes: int,
        description: str,
    ) -> BuiltStep:
        """The plain JAX + optax step minimizing ``loss_fn(compute_params, batch)`` (a float32
        scalar) with the optimizer called ``optimizer`` (:func:`make_optimizer`), ``params``
        cast to ``policy``'s compute dtype for the loss, the gradients summed over
        ``microbatches`` micro-batches of ``batch``; its optimizer state initialized."""
        opt = make_optimizer(optimizer)
        return cls(
            step=train_step(loss_fn, opt, policy, microbatches),
            params=params,
            opt_state=opt.init(params),
            batch=batch,
            activation_bytes=activation_bytes,
            description=description,
        )


def make_optimizer(name: str, learning_rate: float = 1e-3) -> optax.GradientTransformation:
    """The optax optimizer called ``name`` (one of ``estimate.OPTIMIZERS``)."""
    makers = {
        "sgd": lambda: optax.sgd(learning_rate),
        "momentum": lambda: optax.sgd(learning_rate, momentum=0.9),
        "lion": lambda: optax.lion(learning_rate),
        "adam": lambda: optax.adam(learning_rate),
        "adamw": lambda: optax.adamw(learning_rate),
    }
    if name not in makers:
        raise ValueError(f"unknown optimizer {name!r}; allowed: {', '.join(makers)}")
    return makers[name]()


def _check(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def train_step(
    loss_fn: Callable[[Any, Any], jax.Array],
    opt: optax.GradientTransformation,
    policy: Policy,
    microbatches: int,
) -> Callable[..., Any]:
    def grads_of(params: Any, batch: Any) -> tuple[jax.Array, Any]:
        def compute_loss(p: Any) -> jax.Array:
            return loss_fn(policy.cast_to_compute(p), batch)

        return jax.value_and_grad(compute_loss)(params)

    def step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        if microbatches == 1:
            loss, grads = grads_of(params, batch)
        else:
            split = jax.tree_util.tree_map(
                lambda a: a.reshape((microbatches, a.shape[0] // microbatches, *a.shape[1:])),
                batch,
            )

            def accumulate(carry: Any, micro: Any) -> tuple[Any, None]:
                total, acc = carry
                loss, g = grads_of(params, micro)
                acc = jax.tree_util.tree_map(lambda a, b: a + b.astype(a.dtype), acc, g)
                return (total + loss, acc), None

            zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
            (total, acc), _ = jax.lax.scan(accumulate, (jnp.float32(0), zeros), split)
            scale = jnp.float32(1.0 / microbatches)
            loss = total * scale
            grads = jax.tree_util.tree_map(lambda a: a * scale.astype(a.dtype), acc)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def stack_step(
    *,
    n_layers: int = 16,
    d_model: int = 128,
    batch: int = 256,
    policy: Policy | str = "f32",
    optimizer: str = "adam",
    checkpoint_every: int | None = None,
    microbatches: int = 1,
    seed: int = 0,
) -> BuiltStep:
    """A residual tanh stack; see the module docstring.

    Each block saves its input x, tanh(x W1) and 1 - tanh^2 (three ``micro x d_model`` arrays in
    the compute dtype); with checkpointing every K blocks, ``n_layers / K`` boundary inputs are
    kept and one segment of K blocks is recomputed in the backward pass.
    """
    policy = get_policy(policy)
    _check(n_layers, "n_layers")
    _check(d_model, "d_model")
    _check(batch, "batch")
    _check(microbatches, "microbatches")
    if batch % microbatches:
        raise ValueError(f"batch {batch} is not divisible into {microbatches} micro-batches")
    if checkpoint_every is not None:
        _check(checkpoint_every, "checkpoint_every")
        if n_layers % checkpoint_every:
            raise ValueError(f"checkpoint_every={checkpoint_every} must divide n_layers={n_layers}")
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    scale = 1.0 / np.sqrt(d_model)
    params = {
        "w1": (jax.random.normal(k1, (n_layers, d_model, d_model)) * scale).astype(
            policy.param_dtype
        ),
        "w2": (jax.random.normal(k2, (n_layers, d_model, d_model)) * scale * 0.1).astype(
            policy.param_dtype
        ),
    }
    x = jax.random.normal(k3, (batch, d_model), jnp.float32)
    dtype = policy.compute_dtype

    def block(h: jax.Array, w: dict[str, jax.Array]) -> tuple[jax.Array, None]:
        return h + jnp.tanh(h @ w["w1"]) @ w["w2"], None

    def run_layers(h: jax.Array, ws: dict[str, jax.Array]) -> tuple[jax.Array, None]:
        h, _ = jax.lax.scan(block, h, ws)
        return h, None

    def loss_fn(p: dict[str, jax.Array], xb: jax.Array) -> jax.Array:
        h = xb.astype(dtype)
        if checkpoint_every is None:
            h, _ = run_layers(h, p)
        else:
            k = checkpoint_every
            segments = jax.tree_util.tree_map(
                lambda a: a.reshape((n_layers // k, k, *a.shape[1:])), p
            )
            h, _ = jax.lax.scan(jax.checkpoint(run_layers), h, segments)
        return jnp.mean(jnp.square(h.astype(jnp.float32)))

    micro = batch // microbatches
    unit = micro * d_model * np.dtype(dtype).itemsize
    if checkpoint_every is None:
        activations = 3 * n_layers * unit
    else:
        activations = (n_layers // checkpoint_every) * unit + 3 * checkpoint_every * unit
    ckpt = f", checkpoint every {checkpoint_every}" if checkpoint_every else ""
    acc = f", {microbatches} micro-batches" if microbatches > 1 else ""
    what = (
        f"residual tanh stack: {n_layers} layers, d_model {d_model}, batch {batch}, {policy}, "
        f"{optimizer}{ckpt}{acc}"
    )
    return BuiltStep.of(loss_fn, params, x, policy, optimizer, microbatches, activations, what)
