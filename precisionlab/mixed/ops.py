"""Numerically sensitive ops that honour a policy's float32 list.

Each op computes in float32 when the policy keeps it there (``Policy.fp32_ops``), else in the
compute dtype, and returns the compute dtype (``cross_entropy`` returns float32 when kept in
float32: it is the loss). Under a policy with ``enforce=True`` (the default; ``Policy.enforce``)
each result is rounded to the compute dtype at the op boundary (see
:mod:`precisionlab.mixed._numerics`), so CPU runs round and overflow where a GPU would.

Op names in ``Policy.fp32_ops``: ``softmax``, ``layer_norm``, ``cross_entropy``, ``reduce``
(large sums and means), ``matmul_accumulate`` (matmuls accumulate in float32 and round once, as
tensor cores do; without it the product is only *requested* in the compute dtype, and the backend
picks the accumulator: XLA on CPU still accumulates in float32 and rounds once, so on CPU both
settings give the same bits. Low-precision accumulation is not emulated).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab.mixed._numerics import enforce as _enforce
from precisionlab.mixed._policy import Policy

__all__ = [
    "accuracy",
    "boundary",
    "conv2d",
    "cross_entropy",
    "dense",
    "gelu",
    "layer_norm",
    "log_softmax",
    "matmul",
    "reduce_mean",
    "reduce_sum",
    "relu",
    "softmax",
]

_FP32 = np.dtype("float32")
_Axes = int | tuple[int, ...] | None


def _policy(policy: Policy | None) -> Policy:
    return Policy() if policy is None else policy


def boundary(x: jax.Array, policy: Policy | None) -> jax.Array:
    """Cast ``x`` to the compute dtype and, if ``policy.enforce``, force its rounding and
    overflow there."""
    p = _policy(policy)
    x = jnp.asarray(x).astype(p.compute_dtype)
    return _enforce(x) if p.enforce else x


def _in(x: jax.Array, policy: Policy, op: str) -> jax.Array:
    return jnp.asarray(x).astype(policy.op_dtype(op))


def softmax(
    x: jax.Array,
    axis: int = -1,
    *,
    policy: Policy | None = None,
    where: jax.Array | None = None,
) -> jax.Array:
    """Softmax over ``axis`` (max-subtracted); returns the compute dtype."""
    p = _policy(policy)
    y = jax.nn.softmax(_in(x, p, "softmax"), axis=axis, where=where)
    return boundary(y, p)


def log_softmax(x: jax.Array, axis: int = -1, *, policy: Policy | None = None) -> jax.Array:
    """Log-softmax over ``axis``; computed like :func:`softmax`, returns the compute dtype."""
    p = _policy(policy)
    y = jax.nn.log_softmax(_in(x, p, "softmax"), axis=axis)
    return boundary(y, p)


def layer_norm(
    x: jax.Array,
    scale: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    axis: int = -1,
    eps: float = 1e-5,
    policy: Policy | None = None,
) -> jax.Array:
    """LayerNorm over ``axis``: (x - mean) / sqrt(var + eps) * scale + bias; compute dtype out."""
    p = _policy(policy)
    dt = p.op_dtype("layer_norm")
    xf = _in(x, p, "layer_norm")
    mean = jnp.mean(xf, axis=axis, keepdims=True, dtype=dt)
    var = jnp.mean(jnp.square(xf - mean), axis=axis, keepdims=True, dtype=dt)
    y = (xf - mean) * jax.lax.rsqrt(var + jnp.asarray(eps, dt))
    if scale is not None:
        y = y * jnp.asarray(scale).astype(dt)
    if bias is not None:
        y = y + jnp.asarray(bias).astype(dt)
    return boundary(y, p)


def cross_entropy(
    logits: jax.Array,
    labels: jax.Array,
    *,
    policy: Policy | None = None,
    mask: jax.Array | None = None,
) -> jax.Array:
    """Mean softmax cross-entropy of integer ``labels`` [...] under ``logits`` [..., C].

    Returns a scalar in float32 when the policy keeps ``cross_entropy`` in float32, else in the
    compute dtype (rounded there). ``mask`` (same shape as labels) weights the mean.
    """
    p = _policy(policy)
    dt = p.op_dtype("cross_entropy")
    lf = _in(logits, p, "cross_entropy")
    logp = jax.nn.log_softmax(lf, axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    if dt != _FP32 and p.enforce:
        nll = _enforce(nll)
    if mask is None:
        loss = jnp.mean(nll, dtype=dt)
    else:
        m = mask.astype(dt)
        loss = jnp.sum(nll * m, dtype=dt) / jnp.maximum(jnp.sum(m, dtype=dt), 1)
    return _enforce(loss) if (p.enforce and dt != _FP32) else loss


def accuracy(logits: jax.Array, labels: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Fraction (float32 scalar) of argmax(logits) == labels, optionally masked."""
    hit = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    if mask is None:
        return jnp.mean(hit)
    m = mask.astype(jnp.float32)
    return jnp.sum(hit * m) / jnp.maximum(jnp.sum(m), 1.0)


def _reduce(fn: Callable, x: jax.Array, axis: _Axes, policy: Policy | None) -> jax.Array:
    p = _policy(policy)
    y = fn(_in(x, p, "reduce"), axis=axis, dtype=p.op_dtype("reduce"))
    return boundary(y, p)


def reduce_sum(x: jax.Array, axis: _Axes = None, *, policy: Policy | None = None) -> jax.Array:
    """Sum accumulated in float32 if ``reduce`` is kept there; result in the compute dtype."""
    return _reduce(jnp.sum, x, axis, policy)


def reduce_mean(x: jax.Array, axis: _Axes = None, *, policy: Policy | None = None) -> jax.Array:
    """Mean accumulated like :func:`reduce_sum`; result in the compute dtype."""
    return _reduce(jnp.mean, x, axis, policy)


def matmul(a: jax.Array, b: jax.Array, *, policy: Policy | None = None) -> jax.Array:
    """``a @ b`` of compute-dtype operands, rounded once to the compute dtype.

    With ``matmul_accumulate`` in the policy's float32 list the accumulator is float32;
    without it the product is requested in the compute dtype (``preferred_element_type``) and
    the backend picks the accumulator (float32 on XLA's CPU backend: not emulated there).
    """
    p = _policy(policy)
    a = jnp.asarray(a).astype(p.compute_dtype)
    b = jnp.asarray(b).astype(p.compute_dtype)
    y = jnp.matmul(a, b, preferred_element_type=p.op_dtype("matmul_accumulate"))
    return boundary(y, p)


def dense(
    x: jax.Array,
    w: jax.Array,
    b: jax.Array | None = None,
    *,
    policy: Policy | None = None,
) -> jax.Array:
    """``x @ w + b`` in the compute dtype (see :func:`matmul`), rounded at the boundary."""
    p = _policy(policy)
    return _add_bias(matmul(x, w, policy=p), b, p)


def _add_bias(y: jax.Array, b: jax.Array | None, p: Policy) -> jax.Array:
    """``y + b`` in the compute dtype, rounded at the boundary (``y`` when ``b`` is None)."""
    return y if b is None else boundary(y + jnp.asarray(b).astype(p.compute_dtype), p)


def gelu(x: jax.Array, *, policy: Policy | None = None) -> jax.Array:
    """tanh-approximated GELU in the compute dtype, rounded at the boundary."""
    p = _policy(policy)
    return boundary(jax.nn.gelu(jnp.asarray(x).astype(p.compute_dtype)), p)


def relu(x: jax.Array, *, policy: Policy | None = None) -> jax.Array:
    """ReLU in the compute dtype."""
    p = _policy(policy)
    return boundary(jax.nn.relu(jnp.asarray(x).astype(p.compute_dtype)), p)


def conv2d(
    x: jax.Array,
    w: jax.Array,
    b: jax.Array | None = None,
    *,
    padding: str = "SAME",
    policy: Policy | None = None,
) -> jax.Array:
    """2-D convolution, stride 1: ``x`` [B, H, W, C_in] (NHWC), ``w`` [kh, kw, C_in, C_out]
    (HWIO), ``b`` [C_out]; ``padding`` "SAME" or "VALID". Operands in the compute dtype,
    accumulated and rounded once like :func:`matmul` (a convolution is a matmul over patches),
    then the bias added and rounded as in :func:`dense`. Returns [B, H', W', C_out]."""
    if padding not in ("SAME", "VALID"):
        raise ValueError(f"padding must be 'SAME' or 'VALID', got {padding!r}")
    p = _policy(policy)
    x = jnp.asarray(x).astype(p.compute_dtype)
    w = jnp.asarray(w).astype(p.compute_dtype)
    y = jax.lax.conv_general_dilated(
        x,
        w,
        window_strides=(1, 1),
        padding=padding,
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        preferred_element_type=p.op_dtype("matmul_accumulate"),
    )
    return _add_bias(boundary(y, p), b, p)
