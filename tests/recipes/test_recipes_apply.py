"""recipes.apply on models, and delayed-scaling state under transforms.

Oracles: a model written by hand with ``recipes.matmul`` in place of ``@`` (the
transformation must give the same bits); a float64 numpy implementation of Transformer
Engine's delayed-scaling update; one full batch against k micro-batches.
"""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _host_devices import run_on_host_devices
from jax import lax

from precisionlab import recipes as R

F32 = np.float32


def _params(sizes=(32, 64, 32), seed=0):
    keys = jax.random.split(jax.random.key(seed), len(sizes) - 1)
    return [
        jax.random.normal(k, (a, b)) / np.sqrt(a)
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def mlp(params, x, mm=jnp.matmul):
    for w in params[:-1]:
        x = jax.nn.gelu(mm(x, w))
    return mm(x, params[-1])


X = jax.random.normal(jax.random.key(5), (32, 32))


@pytest.mark.parametrize(
    "name",
    [
        "current",
        "mxfp8",
        *(pytest.param(n, marks=pytest.mark.slow) for n in ("rowwise", "nvfp4", "bf16")),
    ],
)
def test_apply_equals_the_hand_written_model(name):
    p = _params()
    kw = {"stochastic_gradients": False} if name == "nvfp4" else {}
    rec = R.get_recipe(name, **kw)
    f = R.apply(lambda p, x: mlp(p, x).sum(), rec)
    by_hand = lambda p, x: mlp(p, x, lambda a, b: R.matmul(a, b, recipe=rec)).sum()  # noqa: E731
    np.testing.assert_array_equal(f(p, X), by_hand(p, X))
    ga = jax.jit(jax.grad(f))(p, X)
    gb = jax.jit(jax.grad(by_hand))(p, X)
    for a, b in zip(ga, gb, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_apply_keeps_first_and_last_in_high_precision():
    p = _params((32, 64, 64, 32))
    f = R.apply(lambda p, x: mlp(p, x), "current", exclude=(0, -1))
    assert [s.selected for s in f.sites(p, X)] == [False, True, False]
    got = f(p, X)
    x = jax.nn.gelu(X @ p[0])
    x = jax.nn.gelu(R.matmul(x, p[1], recipe="current"))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(x @ p[2]))


def test_apply_on_equinox_with_weight_lhs():
    eqx = pytest.importorskip("equinox")
    lin = eqx.nn.Linear(32, 32, key=jax.random.key(0))
    rec = R.get_recipe("blockwise", pad=True)
    f = R.apply(lambda m, x: jax.vmap(m)(x), rec, weight="lhs")
    (site,) = f.sites(lin, X)
    assert site.in_shapes[0] == (32, 32)  # the weight is the lhs in Equinox
    got = f(lin, X)
    rec = R.get_recipe("blockwise", pad=True)
    want = R.matmul(X, lin.weight.T, recipe=rec) + lin.bias  # the weight as rhs, by hand
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


# --- delayed scaling -----------------------------------------------------------------------
def te_update(history, scale, amax, fp8_max, margin=0, algo="max"):
    """float64 oracle of TE DelayedScaling's update for one tensor."""
    history = np.concatenate([[amax], history[:-1]])
    a = history.max() if algo == "max" else history[0]
    new = F32(F32(fp8_max) / F32(a)) / F32(2.0**margin) if a > 0 and np.isfinite(a) else scale
    return history, F32(new)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_update_matches_te_rule(algo):
    rec = R.get_recipe("delayed", amax_history_len=4, amax_compute_algo=algo, margin=1)
    st = R.init_site_state(rec)
    hist = np.zeros((4, 3))
    scale = np.ones(3, F32)
    maxes = (448.0, 448.0, 57344.0)  # lhs E4M3, rhs E4M3, gradient E5M2 (HYBRID)
    for obs in ([2.0, 3.0, 0.5], [1.0, np.inf, 0.0], [0.0, 0.25, 8.0], [5.0, 1.0, 1.0],
                [0.5, 0.5, 0.5]):  # fmt: skip
        st = R.update_site_state(rec, st, jnp.asarray(obs, jnp.float32))
        for i in range(3):
            h, s = te_update(hist[:, i], scale[i], obs[i], maxes[i], 1, algo)
            hist[:, i], scale[i] = h, s
        np.testing.assert_array_equal(np.asarray(st["history"]), hist.astype(F32))
        np.testing.assert_array_equal(np.asarray(st["scale"]), scale)


def _loss(p, x):
    return jnp.sum(mlp(p, x) ** 2) / 32.0  # a sum: micro-batch gradients add up exactly


def test_delayed_microbatches_equal_one_batch_bitwise():
    p = _params()
    x = jax.random.normal(jax.random.key(1), (32, 32))
    f = R.apply(_loss, "delayed")
    st = f.init_state(p, x)
    vg = jax.jit(f.value_and_grad())
    for _ in range(2):  # two steps: the second quantizes with scales from the first
        _, _, full = vg(st, p, x)
        obs = None
        for mb in jnp.split(x, 4):
            _, _, o = vg(st, p, mb)
            obs = o if obs is None else R.combine_observed(obs, o)
        for k in full:
            np.testing.assert_array_equal(np.asarray(obs[k]), np.asarray(full[k]))
        st_full = f.update_state(st, full)
        st_micro = f.update_state(st, obs)
        for a, b in zip(jax.tree.leaves(st_full), jax.tree.leaves(st_micro), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        st = st_full
    assert float(st["dot_general[0]"]["scale"][0]) != 1.0


def test_delayed_observes_true_amaxes_including_scan_layers():
    ws = jnp.stack(_params((32, 32, 32, 32)))

    def model(ws, x):
        h, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return jnp.sum(h**2)

    f = R.apply(model, "delayed")
    st = f.init_state(ws, X)
    assert list(st) == ["dot_general[0]"]
    _, _, obs = f.value_and_grad()(st, ws, X)
    # lhs amax over the 3 layers: max of |input of each layer| (computed with the same
    # quantized model, unquantized amax of its inputs)
    hs = []
    h = X
    for i in range(3):
        hs.append(h)
        h = jnp.tanh(R.matmul(h, ws[i], recipe="delayed", state=st["dot_general[0]"]))
    want_lhs = max(float(jnp.max(jnp.abs(v))) for v in hs)
    assert float(obs["dot_general[0]"][0]) == want_lhs
    assert float(obs["dot_general[0]"][1]) == float(jnp.max(jnp.abs(ws)))


def test_delayed_skipped_step_keeps_state_and_checkpoint_round_trip(tmp_path):
    from precisionlab.train._checkpoint import load_checkpoint, save_checkpoint

    p = _params()
    f = R.apply(_loss, "delayed")
    st = f.init_state(p, X)
    _, _, obs = f.value_and_grad()(st, p, X)
    st1 = f.update_state(st, obs)
    bad = jax.tree.map(lambda o: o.at[2].set(jnp.inf), obs)
    same = jax.jit(f.update_state)(st1, bad, skip=jnp.bool_(True))
    for a, b in zip(jax.tree.leaves(st1), jax.tree.leaves(same), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    save_checkpoint(tmp_path, st1, step=1)
    back, step, _ = load_checkpoint(tmp_path, st)
    assert step == 1
    for a, b in zip(jax.tree.leaves(st1), jax.tree.leaves(back), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    # resuming gives the same next step, bit for bit
    v1, g1, _ = f.value_and_grad()(st1, p, X)
    v2, g2, _ = f.value_and_grad()(back, p, X)
    assert np.asarray(v1).tobytes() == np.asarray(v2).tobytes()
    for a, b in zip(g1, g2, strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


DP_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    assert jax.device_count() == 4
    from precisionlab import recipes as R

    def mlp(p, x):
        return jnp.sum(jnp.tanh(x @ p[0]) @ p[1]) ** 2 / 64.0

    keys = jax.random.split(jax.random.key(0), 3)
    p = [jax.random.normal(keys[0], (32, 32)), jax.random.normal(keys[1], (32, 32))]
    x = jax.random.normal(keys[2], (64, 32))
    f = R.apply(lambda p, x: jnp.sum((jnp.tanh(x @ p[0]) @ p[1]) ** 2) / 64.0, "delayed")
    st = f.init_state(p, x)
    vg = f.value_and_grad()
    _, _, one = jax.jit(vg)(st, p, x)
    mesh = Mesh(np.array(jax.devices()), ("data",))

    def per_device(st, p, xs):
        _, g, obs = vg(st, p, xs)
        return jax.lax.pmax(obs, "data"), jax.lax.psum(g, "data")

    sharded = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P("data")),
                                    out_specs=(P(), P()), check_vma=False))
    four, _ = sharded(st, p, x)
    for k in one:
        np.testing.assert_array_equal(np.asarray(one[k]), np.asarray(four[k]))
    a = f.update_state(st, one)
    b = f.update_state(st, four)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    print("OK")
    """
)


def test_delayed_data_parallel_amax_is_the_max_across_devices():
    run_on_host_devices(DP_SCRIPT, devices=4, timeout=300)


@pytest.mark.parametrize("name", ["mlp", pytest.param("transformer", marks=pytest.mark.slow)])
def test_apply_on_the_builtin_models(name):
    from precisionlab.train import make_data, make_model

    data = make_data("teacher") if name == "mlp" else make_data("markov")
    small = {"width": 32} if name == "mlp" else {}
    model = make_model(name, **data.model_kwargs(), **small)
    params = model.init(jax.random.key(0))
    batch = data.batch(0, 16)
    loss_fn = model.loss_fn("p=f32,c=f32,o=f32")
    f = R.apply(loss_fn, R.get_recipe("mxfp8", pad=True))
    n = len(f.sites(params, batch))
    assert n >= 2
    (loss, aux), grads, _ = jax.jit(f.value_and_grad(has_aux=True))({}, params, batch)
    assert set(aux) == {"metric"}
    (ref, _), ref_grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    assert abs(float(loss) - float(ref)) < 0.05 * abs(float(ref))
    g = jnp.concatenate([v.ravel() for v in jax.tree.leaves(grads)])
    r = jnp.concatenate([v.ravel() for v in jax.tree.leaves(ref_grads)])
    assert float(jnp.linalg.norm(g - r)) <= 0.25 * float(jnp.linalg.norm(r))  # FP8 noise only


def test_einsum_is_the_quantized_dot_general():
    rng = np.random.default_rng(2)
    a = jnp.asarray(rng.standard_normal((2, 8, 32)).astype(F32))
    b = jnp.asarray(rng.standard_normal((2, 32, 4)).astype(F32))
    got = R.einsum("bij,bjk->bik", a, b, recipe="current")
    want = R.dot_general(a, b, (((2,), (1,)), ((0,), (0,))), recipe="current")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.array_equal(np.asarray(got), np.asarray(jnp.einsum("bij,bjk->bik", a, b)))
