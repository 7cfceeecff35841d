"""Every feature inside a user's ``jax.shard_map`` (JAX's default checks on: ``check_vma=True``)
and on arrays placed with ``NamedSharding``.

In this process (one CPU device): the shared feature table (tests/_model_features.py) on a
plain pytree MLP with a convolution, every check's programs run inside ``jax.shard_map`` over
a one-device mesh (the batch sharded over ``"data"``, the model replicated): the varying-axes
types JAX checks are the same as on many devices, and the values those of the unsharded run,
so every effect check applies as it is. Then, on two CPU host devices:

The model is a plain pytree MLP (test_models_plain.py has the scan/remat/vmap one); each
device runs the product's wrappers on its shard of the batch, as a data-parallel user writes
it (a ``psum`` of the gradients, a ``pmax`` of the recipe's amaxes, ``reduce_over`` of the
statistics), and every result is checked against the same wrappers run without sharding on
each shard (values and gradients to float32 summation order, amaxes and counts bitwise).

The device count must be set before jax is imported, so the checks run in a subprocess
(``run_on_host_devices``, tests/conftest.py); the default suite runs a few, ``-m slow`` all.
A wrapper around a function that calls shard_map itself: tests/cli/test_hints.py.
"""

from __future__ import annotations

import textwrap

import jax
import numpy as np
import optax
import pytest
from _model_features import Subject, covers, in_shard_map, params

BATCH, WIDTH, CLASSES = 8, 8, 10


def init(key: jax.Array) -> dict:
    k = jax.random.split(key, 3)
    return {
        "conv": {"kernel": jax.random.normal(k[0], (3, 1, 4)) / 2},  # (width, in, out)
        "w1": jax.random.normal(k[1], (4 * WIDTH, 32)) / 6,
        "w2": jax.random.normal(k[2], (32, CLASSES)) / 6,
    }


def apply(p: dict, x: jax.Array) -> jax.Array:
    """(B, WIDTH) -> (B, CLASSES): a 1-D convolution over the features, then an MLP."""
    h = jax.lax.conv_general_dilated(x[..., None], p["conv"]["kernel"], (1,), "SAME",
                                     dimension_numbers=("NWC", "WIO", "NWC"))  # fmt: skip
    h = jax.nn.gelu(h.reshape(x.shape[0], -1) @ p["w1"])
    return h @ p["w2"]


def criterion(logits: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@pytest.fixture(scope="module")
def subject() -> Subject:
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (BATCH, WIDTH))
    y = jax.random.randint(ky, (BATCH,), 0, CLASSES)
    return Subject(
        "sharded", init(jax.random.key(0)), x, y, apply, criterion,
        jit=lambda fn: in_shard_map(fn, batch=(x, y)), weights=("conv/kernel", "w1", "w2"),
    )  # fmt: skip


@covers("shard_map")
def test_the_checks_run_inside_shard_map(subject):
    """The reference output itself comes from inside shard_map: bitwise the plain jit's, and
    the program holds the shard_map (with JAX's checks on)."""
    np.testing.assert_array_equal(subject.out32, np.asarray(jax.jit(apply)(subject.params,
                                                                           subject.x)))  # fmt: skip
    text = str(jax.make_jaxpr(subject.jit(apply))(subject.params, subject.x))
    assert "shard_map" in text and "check_vma=True" in text, text[:400]


DEFAULT = {"observe", "recipe_current"}


@pytest.mark.parametrize("feature", params(DEFAULT))
def test_feature(subject, feature):
    feature.check(subject)


SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from precisionlab import recipes, telemetry
    from precisionlab.mixed import (
        DynamicLossScale, all_finite, filter_value_and_grad, get_policy, select_tree,
    )

    FULL = sys.argv[1] == "full"
    assert jax.device_count() == 2
    mesh = Mesh(np.array(jax.devices()), ("data",))
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k[0], (8, 32)) / 3,
              "w2": jax.random.normal(k[1], (32, 10)) / 6}
    x = jax.random.normal(k[2], (8, 8))
    y = jax.random.randint(k[3], (8,), 0, 10)
    halves = [(x[:4], y[:4]), (x[4:], y[4:])]

    def loss(p, x, y):
        h = jax.nn.gelu(x @ p["w1"])
        return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"], y).mean()

    def sharded(fn, n_in=3):
        specs = (P(), P("data"), P("data"))[:n_in]
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P()))

    def close(a, b, rtol=1e-5):
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=1e-7)

    # recipes: each device's value_and_grad; gradients of the replicated params come back
    # summed by JAX (the transpose of its implicit pvary), the amaxes per device, pmax'd
    for name in (("delayed", "current", "mxfp8", "nvfp4", "blockwise") if FULL else ("delayed",)):
        f = recipes.apply(loss, name)
        state = f.init_state(params, *halves[0])
        key = jax.random.key(1)

        def step(p, x, y, state=state, f=f):
            value, grads, observed = f.value_and_grad()(state, p, x, y, key=key)
            observed = jax.tree.map(lambda o: jax.lax.pmax(o, "data"), observed)
            return jax.lax.psum(value, "data"), grads, f.update_state(state, observed)

        value, grads, new = sharded(step)(params, x, y)
        one = jax.jit(f.value_and_grad())
        ref = [one(state, params, *h, key=key) for h in halves]
        close(value, ref[0][0] + ref[1][0])
        close(grads, jax.tree.map(jnp.add, ref[0][1], ref[1][1]))
        want = f.update_state(state, jax.tree.map(jnp.maximum, ref[0][2], ref[1][2]))
        for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        print("recipe", name, "ok")

    # telemetry: each device's statistics, reduced over the axis = the whole batch's (by
    # default the first matmul's alone: each statistic compiles to a sizeable program)
    sites = ("dot_general[0]", "dot_general[1]") if FULL else ("dot_general[0]",)
    obs = telemetry.observe(loss, include=sites)

    def observed(p, x, y):
        value, grads, stats = obs.value_and_grad()(p, x, y)
        stats = {k: {r: telemetry.reduce_over(s, "data") for r, s in v.items()}
                 for k, v in stats.items()}
        return jax.lax.psum(value, "data"), grads, stats

    value, grads, stats = sharded(observed)(params, x, y)
    one = jax.jit(obs.value_and_grad())
    ref = [one(params, *h) for h in halves]
    close(grads, jax.tree.map(jnp.add, ref[0][1], ref[1][1]))
    assert set(stats) == set(sites)
    for site in sites:
        for role in ("lhs", "out", "grad"):  # the data's operands: split over the devices
            got, parts = stats[site][role], [r[2][site][role] for r in ref]
            assert int(got.n) == sum(int(p.n) for p in parts), (site, role)
            assert float(got.amax) == max(float(p.amax) for p in parts), (site, role)
    print("observe ok")

    if FULL:
        # every(N) inside shard_map: the skipped step's zeros vary as the statistics do
        def every(p, x, y, step):
            s = telemetry.every(2, step, lambda p, x: obs(p, x, y)[1], p, x)  # noqa: B023
            return jax.tree.map(lambda v: jax.lax.pmax(v, "data"), s["dot_general[0]"]["lhs"].amax)

        run = jax.jit(jax.shard_map(every, mesh=mesh, in_specs=(P(), P("data"), P("data"), P()),
                                    out_specs=P()))
        assert float(run(params, x, y, 0)) == float(jnp.abs(x).max())
        assert float(run(params, x, y, 1)) == 0.0
        print("every ok")

        # dynamic loss scaling with a skipped step, per device, params replicated
        def scaled_step(p, x, y, ls):
            value, g = filter_value_and_grad(lambda q: ls.scale(loss(q, x, y)))(p)
            g = ls.unscale(g)
            finite = all_finite(g)
            new = jax.tree.map(lambda a, b: a - 0.1 * b, p, g)
            return select_tree(finite, new, p), ls.adjust(finite)

        run = jax.jit(jax.shard_map(scaled_step, mesh=mesh,
                                    in_specs=(P(), P("data"), P("data"), P()), out_specs=P()))
        bad = jax.tree.map(lambda a: a.at[0, 0].set(jnp.inf), params)
        kept, ls = run(bad, x, y, DynamicLossScale(init_scale=2.0**10))
        assert all(np.array_equal(a, b, equal_nan=True) for a, b in
                   zip(jax.tree.leaves(kept), jax.tree.leaves(bad), strict=True))
        assert float(ls.loss_scale) == 2.0**9
        moved, ls = run(params, x, y, DynamicLossScale(init_scale=2.0**10))
        assert not np.array_equal(moved["w1"], params["w1"]) and float(ls.loss_scale) == 2.0**10
        print("loss scale ok")

        # a policy cast inside shard_map: the matmuls multiply bfloat16
        pol = get_policy("p=f32,c=bf16,o=f32")
        cast = pol.cast_to_compute
        f = recipes.apply(lambda p, x: cast(x) @ cast(p["w1"]), "current")
        dt = jax.jit(jax.shard_map(lambda p, x: jax.lax.pmax(jnp.abs(f(p, x)).max(), "data"),
                                   mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))(params, x)
        sites = f.sites(params, x)
        assert [s.dtype for s in sites] == ["bfloat16"] and dt.dtype == jnp.bfloat16
        print("policy ok")

    # NamedSharding: the batch placed over the devices, jit partitions the recipe's program
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    ys = jax.device_put(y, NamedSharding(mesh, P("data")))
    assert len(xs.sharding.device_set) == 2
    for name in ("current", "mxfp8") if FULL else ("current",):
        f = jax.jit(jax.value_and_grad(recipes.apply(loss, name)))
        close(f(params, xs, ys), f(params, x, y))
    print("named sharding ok")
    print("OK")
    """
)


def _run(run_on_host_devices, mode: str) -> str:
    script = f"import sys; sys.argv = ['-', {mode!r}]\n" + SCRIPT
    return run_on_host_devices(script, devices=2)


@covers("shard_map", "observe", "matmuls")
def test_a_recipe_and_telemetry_in_shard_map_and_named_sharding(run_on_host_devices):
    out = _run(run_on_host_devices, "default")
    assert "recipe delayed ok" in out and "observe ok" in out and "named sharding ok" in out


@pytest.mark.slow
@covers("shard_map", "observe", "matmuls", "policy")
def test_every_feature_on_two_devices(run_on_host_devices):
    out = _run(run_on_host_devices, "full")
    for line in ("recipe nvfp4 ok", "recipe blockwise ok", "every ok", "loss scale ok",
                 "policy ok"):  # fmt: skip
        assert line in out, out
