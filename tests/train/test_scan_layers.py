"""Built-in models with their identical layers stacked under lax.scan and checkpointed every K
layers: the same numbers as the unrolled layers (the oracle), and clear errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from precisionlab._schema import ConfigError
from precisionlab.mixed._policy import get_policy
from precisionlab.train import TrainConfig, train
from precisionlab.train._layers import (
    REMAT_POLICIES,
    scan_layers,
    stack_layers,
    unstack_layers,
)
from precisionlab.train._models import Transformer, make_model

TINY = {
    "transformer": dict(depth=5, d_model=32, heads=4, seq_len=16, vocab_size=32),
    "mlp": dict(depth=5, width=32, in_dim=16),  # 4 stacked layers after the first
}
#: Shapes where XLA orders a reduction differently in the loop body than unrolled (see
#: test_scan_within_reduction_rounding).
REORDERED = dict(depth=3, d_model=16, heads=2, seq_len=8, vocab_size=16)


def _batch(model):
    shapes = model.example_batch(4)
    rng = np.random.default_rng(0)
    if model.name == "mlp":
        return {
            "x": jnp.asarray(rng.standard_normal(shapes["x"].shape), jnp.float32),
            "y": jnp.asarray(rng.integers(0, model.num_classes, shapes["y"].shape), jnp.int32),
        }
    return {"tokens": jnp.asarray(rng.integers(0, model.vocab_size, (4, model.seq_len + 1)))}


def _loss_grads(model, params, batch, policy="f32"):
    pol = get_policy(policy)
    pc = jax.tree_util.tree_map(lambda a: a.astype(pol.compute_dtype), params)
    fn = jax.jit(jax.value_and_grad(model.loss_fn(pol), has_aux=True))
    (loss, _), grads = fn(pc, batch)
    return loss, grads


def _bitwise(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb, strict=True))


# (remat_every, policy): no checkpointing; groups of 3 with a remainder group (5 = 3 + 2, the
# mlp's 4 = 3 + 1); one group of all layers.
CASES = [(0, "nothing_saveable"), (3, "dots_saveable"), (-1, "nothing_saveable")]


@pytest.mark.parametrize("name", ["mlp"])
def test_scan_equals_unrolled_bitwise_in_float32(name):
    # Oracle: the unrolled layers (the model as it always ran). Loss and every gradient leaf are
    # compared bit for bit; the scanned model's params are the unrolled ones stacked. Bitwise
    # for the relu MLP; with LayerNorm or attention XLA may sum a reduction in another order
    # inside the loop body (next test).
    unrolled = make_model(name, **TINY[name])
    params = unrolled.init(jax.random.PRNGKey(1))
    batch = _batch(unrolled)
    loss0, grads0 = _loss_grads(unrolled, params, batch)
    n = TINY[name]["depth"] - (name == "mlp")
    for k, policy in CASES:
        k = n if k < 0 else k
        scanned = make_model(
            name, scan_layers=True, remat_every=k, remat_policy=policy, **TINY[name]
        )
        sparams = scanned.init(jax.random.PRNGKey(1))
        assert _bitwise(sparams, scanned.stack_params(params))
        loss, grads = _loss_grads(scanned, sparams, batch)
        assert np.array_equal(loss, loss0), (k, policy)
        assert _bitwise(grads, scanned.stack_params(grads0)), (k, policy)


@pytest.mark.parametrize("policy", ["f32", pytest.param("p=f32,c=bf16", marks=pytest.mark.slow)])
def test_scan_within_reduction_rounding(policy):
    # The arithmetic is the unrolled one, but for some shapes XLA fuses a loop body otherwise
    # than the unrolled program and sums a reduction (a LayerNorm statistic, a bias gradient, a
    # small contraction) in another order; a sum in dtype eps rounds at every step. Bound: 8
    # eps of the compute dtype times the leaf's largest magnitude (measured: at most 4).
    unrolled = make_model("transformer", **REORDERED)
    params = unrolled.init(jax.random.PRNGKey(2))
    batch = _batch(unrolled)
    loss0, grads0 = _loss_grads(unrolled, params, batch, policy)
    scanned = make_model("transformer", scan_layers=True, remat_every=2, **REORDERED)
    loss, grads = _loss_grads(scanned, scanned.stack_params(params), batch, policy)
    eps = float(jnp.finfo(get_policy(policy).compute_dtype).eps)
    assert abs(float(loss) - float(loss0)) <= 8 * eps * abs(float(loss0))
    ref = scanned.stack_params(grads0)
    for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref), strict=True):
        g64, r64 = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert np.max(np.abs(g64 - r64)) <= 8 * eps * np.max(np.abs(r64)), np.max(np.abs(g64 - r64))


def test_captured_activations_are_the_unrolled_ones():
    kw = TINY["mlp"]
    unrolled = make_model("mlp", **kw)
    scanned = make_model("mlp", scan_layers=True, remat_every=2, **kw)
    params = unrolled.init(jax.random.PRNGKey(1))
    x = _batch(unrolled)["x"]

    def fwd(m, p):
        return jax.jit(lambda p, x: m.apply(p, x, capture=True))(p, x)

    (logits0, acts0), (logits, acts) = fwd(unrolled, params), fwd(scanned, params)
    assert np.array_equal(logits, logits0)
    assert list(acts) == list(acts0)  # same names, same order
    assert _bitwise(acts, acts0)


def test_train_loop_with_scan_layers_equals_unrolled():
    # Through TrainConfig and the real train step (Adam, float32): the loss of every step
    # bitwise equal; the final params (unstacked) to a few float32 roundings, because XLA fuses
    # the optimizer's elementwise update of a stacked [N, ...] leaf otherwise than of N leaves.
    base = dict(
        model="mlp",
        model_kwargs=dict(depth=4, width=16),
        data="teacher",
        batch_size=16,
        steps=3,
        progress=False,
    )
    ref = train(TrainConfig(**base), quiet=True)
    got = train(TrainConfig(**base, scan_layers=True, remat_every=2), quiet=True)
    assert [m["loss"] for m in got.metrics] == [m["loss"] for m in ref.metrics]
    assert "hidden_stack" in got.state.params
    model = make_model("mlp", depth=4, width=16, in_dim=ref.state.params["hidden"][0]["w"].shape[0])
    unstacked = model.unstack_params(got.state.params)
    leaves = jax.tree_util.tree_leaves
    for a, b in zip(leaves(unstacked), leaves(ref.state.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=8 * np.finfo(np.float32).eps, atol=1e-9)


def test_stack_unstack_round_trip_and_shape_error():
    layers = [{"w": np.full((2, 3), i, np.float32)} for i in range(3)]
    stacked = stack_layers(layers)
    assert stacked["w"].shape == (3, 2, 3)
    assert _bitwise(unstack_layers(stacked), layers)
    with pytest.raises(ValueError, match=r"layer 2 cannot be stacked.*float32\[2, 4\]"):
        stack_layers([*layers[:2], {"w": np.zeros((2, 4), np.float32)}])
    with pytest.raises(ValueError, match=r"block 1 cannot be stacked.*structure"):
        stack_layers([{"w": 1.0}, {"v": 1.0}], "block")


def test_scan_layers_remainder_group_is_applied():
    # 5 layers in groups of 2 (+1): each layer adds its weight once, in order.
    layers = jnp.arange(1.0, 6.0)
    h, ys = scan_layers(lambda w, h: (h * 2 + w, h), layers, jnp.float32(0), remat_every=2)
    expect = 0.0
    for w in range(1, 6):
        expect = expect * 2 + w
    assert float(h) == expect and ys.shape == (5,)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"remat_every": 2}, "remat_every=2 needs scan_layers"),
        ({"scan_layers": True, "remat": True}, "exclusive; with scan_layers use remat_every=1"),
        ({"scan_layers": True, "remat_every": 6}, "exceeds the 5 stacked layers"),
        ({"scan_layers": True, "remat_every": -1}, "remat_every must be an int >= 0"),
        ({"scan_layers": True, "remat_policy": "some"}, "unknown remat_policy 'some'; allowed"),
    ],
)
def test_model_option_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_model("transformer", **TINY["transformer"], **kwargs)


def test_per_layer_options_cannot_be_stacked():
    # A model option holding a per-layer collection (e.g. layers kept in high precision) makes
    # the layers differ: scanning them must fail, naming the option.
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class PerLayer(Transformer):
        keep_layers: tuple[int, ...] = ()

    PerLayer(**TINY["transformer"], keep_layers=(1,))  # unrolled: fine
    PerLayer(**TINY["transformer"], scan_layers=True)  # nothing per layer: fine
    with pytest.raises(ValueError, match="keep_layers set per-layer options"):
        PerLayer(**TINY["transformer"], scan_layers=True, keep_layers=(1,))


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ({"remat_every": 4}, "remat_every=4 needs scan_layers"),
        ({"model": "conv", "data": "digits", "scan_layers": True}, "conv.*allowed: mlp"),
        ({"scan_layers": True, "recipe": "mxfp8"}, "scan_layers with a recipe"),
        ({"scan_layers": True, "remat_policy": "nope"}, "remat_policy"),
        ({"scan_layers": True, "remat": True}, "exclusive"),
    ],
)
def test_train_config_errors(table, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig.from_dict(table)


def test_remat_policies_exist_in_jax():
    for name in REMAT_POLICIES:
        assert callable(getattr(jax.checkpoint_policies, name))


def test_high_precision_layers_and_overflow_knob_refuse_stacking():
    with pytest.raises(ValueError, match="scan_layers stacks identical layers"):
        make_model("mlp", **TINY["mlp"], scan_layers=True, high_precision=("layer2",))
    with pytest.raises(ValueError, match="overflow_layer 2 is a stacked layer"):
        make_model("mlp", **TINY["mlp"], scan_layers=True, overflow_layer=2)
    make_model("mlp", **TINY["mlp"], scan_layers=True, overflow_layer=0)  # layer 0 is unrolled
