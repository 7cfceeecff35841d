"""The jitted train step: unscaled gradients, skip semantics, micro-batches, underflow meter."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from precisionlab.mixed import DynamicLossScale, StaticLossScale, Storage, get_policy
from precisionlab.train import make_train_step
from precisionlab.train._step import make_grad_fn

RNG = np.random.default_rng(0)
PARAMS = {
    "w1": jnp.asarray(RNG.normal(size=(8, 16)) * 0.3, jnp.float32),
    "w2": jnp.asarray(RNG.normal(size=(16, 3)) * 0.3, jnp.float32),
}
BATCH = {
    "x": jnp.asarray(RNG.normal(size=(32, 8)), jnp.float32),
    "y": jnp.asarray(RNG.integers(0, 3, 32), jnp.int32),
}


def loss_fn(p, batch):
    h = jnp.tanh(batch["x"].astype(p["w1"].dtype) @ p["w1"])
    logits = (h @ p["w2"]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    loss = -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))
    return loss, {"metric": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}


@pytest.mark.parametrize("scale", [StaticLossScale(2.0**12), DynamicLossScale(2.0**15)])
def test_unscaled_grads_equal_unscaled_loss_grads(scale):
    pol = get_policy("float32")
    grad_fn = jax.jit(make_grad_fn(loss_fn, pol))
    loss, _, g_scaled, _, _ = grad_fn(PARAMS, BATCH, scale, {})
    got = scale.unscale(g_scaled)
    ref = jax.jit(jax.grad(lambda p: loss_fn(p, BATCH)[0]))(PARAMS)
    for k in ref:
        # Power-of-two scales are exact in float32: bitwise equal.
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(ref[k]))
    assert float(loss) == float(jax.jit(loss_fn)(PARAMS, BATCH)[0])


@pytest.mark.parametrize("skip", ["select", "cond"])
def test_skip_leaves_state_bitwise_untouched(skip):
    def lossy(p, batch):
        return loss_fn(p, batch)[0] * batch["bad"]

    step, state = make_train_step(
        lossy,
        PARAMS,
        optax.adam(1e-2),
        policy="p=bf16,c=bf16,o=f32",
        loss_scale="dynamic",
        storage=Storage(update="kahan", opt_state="bfloat16"),
        skip=skip,
        report_leaves=True,
    )
    jstep = jax.jit(step)
    good = {**BATCH, "bad": jnp.float32(1.0)}
    state, m = jstep(state, good)
    assert not bool(m["skipped"])
    before = jax.device_get(state)
    state, m = jstep(state, {**BATCH, "bad": jnp.float32(jnp.inf)})
    assert bool(m["skipped"]) and not bool(np.all(m["finite_leaves"]))
    after = jax.device_get(state)
    for name in ("params", "opt_state", "storage_state"):
        for a, b in zip(
            jax.tree_util.tree_leaves(getattr(before, name)),
            jax.tree_util.tree_leaves(getattr(after, name)),
            strict=True,
        ):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(
                np.atleast_1d(np.asarray(a)).view(np.uint8),
                np.atleast_1d(np.asarray(b)).view(np.uint8),
            )
    assert float(after.loss_scale.loss_scale) == float(before.loss_scale.loss_scale) / 2
    assert int(after.step) == int(before.step) + 1
    state, m = jstep(state, good)
    assert not bool(m["skipped"])


def test_microbatches_match_full_batch():
    outs = []
    for micro in (1, 4):
        step, state = make_train_step(loss_fn, PARAMS, optax.sgd(0.1), microbatches=micro)
        state, m = jax.jit(step)(state, BATCH)
        outs.append((state.params, m))
    for k in PARAMS:
        np.testing.assert_allclose(outs[0][0][k], outs[1][0][k], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(float(outs[0][1]["loss"]), float(outs[1][1]["loss"]), rtol=1e-6)
    with pytest.raises(ValueError, match="microbatches"):
        make_train_step(loss_fn, PARAMS, optax.sgd(0.1), microbatches=0)


def _tiny_loss(p, batch):
    # d loss / d w = x * 1e-9: below float16's smallest subnormal (2**-24 ~ 6e-8) unless scaled.
    return jnp.sum(p["w"] * batch["x"].astype(p["w"].dtype)).astype(jnp.float32) * 1e-9


@pytest.mark.parametrize(
    ("policy", "scale"), [("c=f16", "none"), ("c=f16", "static:65536"), ("float32", "none")]
)
def test_underflow_meter(policy, scale):
    x = jnp.asarray(RNG.uniform(0.5, 2.0, size=(64,)), jnp.float32)
    step, state = make_train_step(
        _tiny_loss, {"w": jnp.ones(64)}, optax.sgd(1.0), policy=policy, loss_scale=scale
    )
    _, m = jax.jit(step)(state, {"x": x})
    # Reference: the scaled gradient x * 1e-9 * S as the compute dtype holds it (ml_dtypes cast).
    s = 1.0 if scale == "none" else 65536.0
    g = (np.asarray(x, np.float64) * 1e-9 * s).astype(np.float16 if "f16" in policy else np.float32)
    tiny = np.finfo(g.dtype).tiny
    expect = np.mean(np.abs(g.astype(np.float64)) < tiny)
    assert float(m["underflow_fraction"]) == pytest.approx(expect)
    assert (expect == 1.0) == (policy == "c=f16" and scale == "none")


def test_errors():
    with pytest.raises(ValueError, match="unknown skip mode"):
        make_train_step(loss_fn, PARAMS, optax.sgd(0.1), skip="where")
    with pytest.raises(TypeError, match="storage"):
        make_train_step(loss_fn, PARAMS, optax.sgd(0.1), storage="bf16")
    with pytest.raises(ValueError, match="unknown loss-scale"):
        make_train_step(loss_fn, PARAMS, optax.sgd(0.1), loss_scale="auto")


@pytest.mark.parametrize(
    ("x", "skipped", "leaves"),
    [
        ([1.0, np.inf, 2.0], True, ["['a']"]),  # one inf element in one leaf: skip, name it
        ([1.0, np.nan, 2.0], True, ["['a']"]),
        ([1e20, 1.0, 2.0], False, []),  # huge but finite: not skipped (norm overflows to inf)
        ([1.0, 2.0, 3.0], False, []),
    ],
)
def test_finiteness_check_per_element(x, skipped, leaves):
    from precisionlab.mixed import nonfinite_leaf_names

    params = {"a": jnp.ones(3), "b": jnp.ones(2)}

    def lin(p, batch):
        return jnp.sum(p["a"] * batch["x"]) + jnp.sum(p["b"])

    step, state = make_train_step(
        lin, params, optax.sgd(1e-30), loss_scale="static:1", report_leaves=True
    )
    new, m = jax.jit(step)(state, {"x": jnp.asarray(x, jnp.float32)})
    assert bool(m["skipped"]) == skipped
    assert nonfinite_leaf_names(params, m["finite_leaves"]) == leaves
    if skipped:
        np.testing.assert_array_equal(new.params["a"], params["a"])
    else:
        assert not np.isnan(float(m["grad_norm"]))
