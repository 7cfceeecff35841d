"""Every feature on an Equinox model: the CNN of Equinox's MNIST tutorial (``eqx.nn.Conv2d``,
a max pool, ``jax.nn`` activations and ``jnp.ravel`` stored as layers, ``eqx.nn.Linear``),
batched with ``jax.vmap``, trained with ``eqx.filter_jit``, ``eqx.filter_value_and_grad`` and
optax adamw on ``eqx.filter(model, eqx.is_array)``; shrunk to 8x8 images.

The model's pytree holds functions (``jax.nn.relu`` is a ``custom_jvp`` function) among its
leaves, so every precisionlab entry point that takes a model or its gradients is run on it
here, each with its effect checked (:data:`ENTRY_POINTS`); then the shared feature table
(tests/_model_features.py).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from _model_features import Subject, covers, params

from precisionlab import memory, recipes, telemetry, train
from precisionlab.diagnose import AutoSwitchRecipe
from precisionlab.mixed import (
    DynamicLossScale,
    all_finite,
    apply_updates,
    enforce_tree,
    filter_value_and_grad,
    get_policy,
    init_storage_state,
    leaf_finite,
    nonfinite_leaf_names,
    select_tree,
    store_opt_state,
)

BATCH, SIDE, CLASSES = 4, 8, 10


class CNN(eqx.Module):
    layers: list

    def __init__(self, key: jax.Array):
        key1, key2, key3 = jax.random.split(key, 3)
        self.layers = [
            eqx.nn.Conv2d(1, 3, kernel_size=3, key=key1),
            eqx.nn.MaxPool2d(kernel_size=2),
            jax.nn.relu,
            jnp.ravel,
            eqx.nn.Linear(3 * 5 * 5, 16, key=key2),
            jax.nn.sigmoid,
            eqx.nn.Linear(16, CLASSES, key=key3),
            jax.nn.log_softmax,
        ]

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return x


def cross_entropy(pred_y: jax.Array, y: jax.Array) -> jax.Array:
    pred_y = jnp.take_along_axis(pred_y, jnp.expand_dims(y, 1), axis=1)
    return -jnp.mean(pred_y)


def batched(model: CNN, x: jax.Array) -> jax.Array:
    return jax.vmap(model)(x)


def loss(model: CNN, x: jax.Array, y: jax.Array) -> jax.Array:
    return cross_entropy(batched(model, x), y)


@pytest.fixture(scope="module")
def subject() -> Subject:
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (BATCH, 1, SIDE, SIDE))
    y = jax.random.randint(ky, (BATCH,), 0, CLASSES)
    return Subject(
        "equinox", CNN(jax.random.key(0)), x, y, batched, cross_entropy, weight="lhs",
        jit=eqx.filter_jit, value_and_grad=eqx.filter_value_and_grad,
        weights=("layers/0/weight", "layers/4/weight", "layers/6/weight"),
    )  # fmt: skip


@pytest.fixture(scope="module")
def grads(subject):
    """``eqx.filter_grad``'s gradients: None at the function leaves."""
    return subject.grads32[1]


def _arrays(tree):
    return [np.asarray(v) for v in jax.tree.leaves(tree) if eqx.is_array(v)]


def _same(a, b) -> bool:
    """The array leaves of ``a`` and ``b`` bitwise equal, pairwise."""
    return all(np.array_equal(x, y) for x, y in zip(_arrays(a), _arrays(b), strict=True))


def _functions(tree):
    return [v for v in jax.tree.leaves(tree) if callable(v)]


def test_the_model_holds_functions_jax_refuses(subject):
    funcs = _functions(subject.params)
    assert jax.nn.relu in funcs and jnp.ravel in funcs
    with pytest.raises(TypeError):  # what a user met before the entry points filtered
        jax.value_and_grad(loss)(subject.params, subject.x, subject.y)


# --- every entry point taking a model or its gradients ---------------------------------------
@covers("filter")
def test_select_tree_selects_arrays_and_keeps_the_functions(subject):
    other = jax.tree.map(lambda v: v + 1 if eqx.is_array(v) else v, subject.params)
    for pred, want in ((True, subject.params), (False, other)):
        got = select_tree(jnp.bool_(pred), subject.params, other)
        assert _same(got, want)
        assert _functions(got) == _functions(subject.params)
    changed = eqx.tree_at(lambda m: m.layers[2], other, jax.nn.gelu)
    with pytest.raises(ValueError, match=r"\.layers\[2\].*differs"):
        select_tree(jnp.bool_(True), subject.params, changed)


def test_finite_checks_skip_the_functions_and_name_the_bad_leaf(subject, grads):
    n_float = len(_arrays(grads))
    assert len(leaf_finite(grads)) == n_float and bool(all_finite(grads))
    poison = lambda w: w.at[0, 0].set(jnp.inf)  # noqa: E731
    bad = eqx.tree_at(lambda g: g.layers[4].weight, grads, replace_fn=poison)
    assert not bool(all_finite(bad))
    flags = leaf_finite(bad)
    assert nonfinite_leaf_names(bad, jnp.stack(flags)) == [".layers[4].weight"]
    assert len(leaf_finite(subject.params)) == len(_arrays(subject.params))  # the model too


def test_loss_scale_scales_arrays_exactly_and_passes_functions(subject):
    ls = DynamicLossScale(init_scale=2.0**8)
    scaled = ls.scale(subject.params)
    for a, b in zip(_arrays(scaled), _arrays(subject.params), strict=True):
        np.testing.assert_array_equal(a, b * np.float32(256))
    assert _functions(scaled) == _functions(subject.params)
    back = ls.unscale(scaled)
    assert _same(back, subject.params)


def test_policy_casts_and_enforce_round_the_arrays_only(subject):
    cast = get_policy("p=f32,c=bf16,o=f32").cast_to_compute(subject.params)
    assert {a.dtype for a in _arrays(cast)} == {np.dtype(jnp.bfloat16)}
    assert _functions(cast) == _functions(subject.params)
    rounded = enforce_tree(subject.params, jnp.bfloat16)
    for a, b in zip(_arrays(rounded), _arrays(subject.params), strict=True):
        assert a.dtype == np.float32  # bfloat16 values held in float32
        np.testing.assert_array_equal(a, b.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert _functions(rounded) == _functions(subject.params)


@pytest.mark.parametrize(
    "modes", [("nearest", "kahan"), pytest.param(("stochastic",), marks=pytest.mark.slow)]
)
def test_storage_stores_the_optimizer_state_and_updates_a_model(subject, grads, modes):
    """A bfloat16 model (master weights below float32) updated by store_opt_state's bfloat16
    adam with each rounding: every float leaf moves, the functions stay."""
    model = get_policy("bf16").cast_to_param(subject.params)
    opt = store_opt_state(optax.adam(1e-2), "bfloat16")
    opt_state = opt.init(model)
    moments = [v for v in jax.tree.leaves(opt_state) if eqx.is_array(v) and v.ndim]
    assert moments and {v.dtype for v in moments} == {np.dtype(jnp.bfloat16)}

    @eqx.filter_jit
    def updated(model, grads, opt_state):
        updates, _ = opt.update(grads, opt_state, model)
        out = {}
        for mode in modes:
            state = init_storage_state(model, mode)
            out[mode] = apply_updates(model, updates, state, update=mode, key=jax.random.key(0))
        return updates, out

    updates, out = updated(model, grads, opt_state)
    assert jax.tree.structure(updates) == jax.tree.structure(grads)
    for mode, (new, _) in out.items():
        assert _functions(new) == _functions(model), mode
        for a, b in zip(_arrays(new), _arrays(model), strict=True):
            assert a.dtype == b.dtype and not np.array_equal(a, b), mode


@covers("filter", "observe")
def test_observe_value_and_grad_equals_filter_value_and_grad(subject):
    """The observed tensors themselves (``tensors=True``: their statistics cost compile time
    and are checked in tests/_model_features.py): the first Linear's input is the flattened
    max pool, its cotangent as wide as its output."""
    vg = eqx.filter_jit(telemetry.observe(loss).value_and_grad(tensors=True))
    value, g, seen = vg(subject.params, subject.x, subject.y)
    ref_value, ref = subject.grads32
    assert float(value) == float(ref_value)
    assert jax.tree.structure(g) == jax.tree.structure(ref)  # None at the functions
    assert _same(g, ref)
    # the convolution and the two Linear layers
    assert set(seen) == {"conv_general_dilated[0]", "dot_general[0]", "dot_general[1]"}
    first = seen["dot_general[0]"]
    np.testing.assert_array_equal(first["lhs"], subject.params.layers[4].weight)  # w @ x
    assert first["rhs"].shape == (BATCH, 75) and first["grad"].shape == (16, BATCH)


@covers("filter", "conv")
def test_applied_value_and_grad_takes_the_model(subject):
    f = recipes.apply(loss, "delayed", weight="lhs")
    state = f.init_state(subject.params, subject.x, subject.y)
    vg = eqx.filter_jit(f.value_and_grad())
    _, g, observed = vg(state, subject.params, subject.x, subject.y)
    ref = subject.grads32[1]
    assert jax.tree.structure(g) == jax.tree.structure(ref)
    assert not _same(g, ref)
    sites = {"conv_general_dilated[0]", "dot_general[0]", "dot_general[1]"}
    assert set(observed) == set(state) == sites
    assert all(bool((o > 0).all()) for o in observed.values())


@covers("filter", "autoswitch")
def test_autoswitch_value_and_grad_takes_the_model(subject):
    spec = AutoSwitchRecipe(recipes.get_recipe("current"), include=(-1,), underflow=0.0, mse=0.0)
    f = spec.apply(loss)
    state = f.init_state(subject.params, subject.x, subject.y)

    @eqx.filter_jit
    def step(state, model, x, y):
        _, g, observed = f.value_and_grad()(state, model, x, y)
        return g, f.update_state(state, observed)

    g, new = step(state, subject.params, subject.x, subject.y)
    assert jax.tree.structure(g) == jax.tree.structure(subject.grads32[1])
    assert list(new) == ["dot_general[1]"]  # the head
    assert {float(v["switched"]) for v in new.values()} == {1.0}


@covers("filter", "observe")
def test_tree_stats_every_meters_and_bytes_skip_the_functions(subject):
    arrays = _arrays(subject.params)
    by_path = {
        jax.tree_util.keystr(p): np.asarray(v)
        for p, v in jax.tree_util.tree_leaves_with_path(subject.params)
        if eqx.is_array(v)
    }

    @eqx.filter_jit
    def measured(step, model, x):
        every = telemetry.every(2, step, lambda m, x: jnp.abs(batched(m, x)).max(), model, x)
        return every, (train.underflow_fraction(model), train.log2_histogram(model)["zeros"])

    # (the statistics' values are tested in test_telemetry*.py; compiling 6 costs seconds)
    stats = eqx.filter_eval_shape(telemetry.tree_stats, subject.params)
    assert set(stats) == set(by_path) and ".layers[4].weight" in stats
    on, (under, zeros) = measured(0, subject.params, subject.x)
    assert float(on) == float(np.abs(subject.out32).max())
    assert float(measured(1, subject.params, subject.x)[0]) == 0
    total = sum(a.size for a in arrays)
    tiny = np.finfo(np.float32).tiny
    assert float(under) == np.float32(sum(int(np.sum(np.abs(a) < tiny)) for a in arrays) / total)
    assert int(zeros) == sum(int(np.sum(a == 0)) for a in arrays)
    assert memory.tree_bytes(subject.params) == sum(a.nbytes for a in arrays)


def test_build_step_refuses_the_model_with_advice_that_works(subject):
    """The train step holds its state through jax.jit, so build_step takes arrays: given the
    whole model, a TypeError names the function leaf and the partition to do, as code; that
    code, run as it is, gives a step that trains."""
    batch = (subject.x, subject.y)
    with pytest.raises(TypeError, match=r"params\.layers\[1\]\.operation is a function") as err:
        train.build_step(lambda m, b: loss(m, *b), subject.params, optax.adam(1e-2))
    advice = str(err.value).split("close over the rest: ")[1]
    first, second = advice.split(" and ")
    ns = {"eqx": eqx, "model": subject.params, "loss": lambda m, b: loss(m, *b)}
    exec(first, ns)  # params, static = eqx.partition(model, eqx.is_array)
    loss_fn = eval(second.removeprefix("loss_fn="), ns)
    step, state, _ = train.build_step(loss_fn, ns["params"], optax.adam(1e-2))
    step = jax.jit(step)
    first_loss = float(step(state, batch)[1]["loss"])
    assert first_loss == pytest.approx(float(subject.grads32[0]), rel=1e-6)


@covers("filter")
def test_filter_value_and_grad_is_equinox_s(subject):
    ours = eqx.filter_jit(filter_value_and_grad(loss))(subject.params, subject.x, subject.y)
    theirs = subject.grads32  # eqx.filter_value_and_grad, jitted
    assert float(ours[0]) == float(theirs[0])
    assert jax.tree.structure(ours[1]) == jax.tree.structure(theirs[1])
    assert _same(ours[1], theirs[1])


@covers("audit")
def test_audit_warns_when_an_mlp_computes_in_float32():
    """The CNN's float32 fall-through cannot happen silently (lax.conv refuses a float32
    input with bfloat16 weights: the shared audit check sees JAX's TypeError). An
    ``eqx.nn.MLP`` cast to bfloat16 with its input left float32 runs: every ``w @ x``
    promotes to float32, and the audit warns, naming the first layer's weight; the run is
    bitwise the float32 MLP on the bfloat16-rounded weights."""
    from precisionlab.compute_audit import ComputeDtypeWarning, audit

    mlp = eqx.nn.MLP(8, 4, 16, depth=2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (4, 8))
    policy = get_policy("p=f32,c=bf16,o=f32")

    def cast_only(model, x):
        return jax.vmap(policy.cast_to_compute(model))(x)

    with pytest.warns(ComputeDtypeWarning, match=r"100%.*layers/0/weight"):
        a = audit(cast_only, mlp, x, policy=policy)
    assert a.share("float32") == 1.0 and len(a.sites) == 3
    rounded = jax.tree.map(
        lambda v: v.astype(jnp.bfloat16).astype(jnp.float32) if eqx.is_array(v) else v, mlp
    )
    np.testing.assert_array_equal(np.asarray(cast_only(mlp, x)), np.asarray(jax.vmap(rounded)(x)))


# --- training as Equinox's tutorial does, with a recipe -----------------------------------
@pytest.mark.slow
@covers("matmuls", "conv")
def test_tutorial_training_step_with_a_delayed_recipe(subject):
    """The tutorial's make_step (eqx.filter_jit, optax adamw on eqx.filter(model,
    eqx.is_array), eqx.apply_updates) with the loss under delayed FP8 scaling: the loss
    falls and the amax history fills."""
    f = recipes.apply(loss, "delayed", weight="lhs")
    optim = optax.adamw(3e-2)

    @eqx.filter_jit
    def make_step(model, opt_state, rstate, x, y):
        value, grads, observed = f.value_and_grad()(rstate, model, x, y)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return model, opt_state, f.update_state(rstate, observed), value

    model = subject.params
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    rstate = f.init_state(model, subject.x, subject.y)
    losses = []
    for _ in range(5):
        model, opt_state, rstate, value = make_step(model, opt_state, rstate, subject.x, subject.y)
        losses.append(float(value))
    assert losses[-1] < losses[0]
    assert all((np.asarray(s["history"])[:5] > 0).all() for s in rstate.values())


# --- the shared feature table ----------------------------------------------------------------
# the entry points above are its default, and two cheap checks of the table
@pytest.mark.parametrize("feature", params({"skipped_listed_and_warned", "select_tree"}))
def test_feature(subject, feature):
    feature.check(subject)
