"""The published FP4 recipes (precisionlab.recipes._fp4): each GEMM as its paper says.

Oracles: the existing NVFP4 recipe (bit for bit), the public quantizers composed by hand
(``fake_quant`` by name, numpy references of tests/quant/test_fp4_quant.py), the high-precision
product (unbiasedness over many keys, a stated confidence), and hand-built weights for
Q-EMA, OutControl and OsciReset.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from precisionlab.quant import fake_quant, fp4
from precisionlab.recipes import (
    RECIPE_NAMES,
    apply,
    dot_general,
    get_recipe,
    matmul,
    osci_reset,
)

FP4 = ("nvidia_fp4", "tseng_fp4", "quartet", "quartet2", "four_over_six", "tetrajet",
       "tetrajet_v2", "fp4_all_the_way")  # fmt: skip
DN = (((1,), (0,)), ((), ()))


def _data(m=64, k=64, n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
    w = jnp.asarray((rng.standard_normal((k, n)) / 8).astype(np.float32))
    g = jnp.asarray(rng.standard_normal((m, n)).astype(np.float32))
    return x, w, g


def _vjp(recipe, x, w, g, key):
    y, f = jax.vjp(lambda a, b: dot_general(a, b, DN, recipe=recipe, key=key), x, w)
    return (y, *f(g))


def _bf16(t):
    return t.astype(jnp.bfloat16).astype(jnp.float32)


def _hp(x, w):
    return jnp.matmul(x, w, precision=jax.lax.Precision.HIGHEST)


# --- names, fields, errors ------------------------------------------------------------------
def test_every_fp4_recipe_is_named_and_takes_its_formats():
    for name in FP4:
        assert name in RECIPE_NAMES
        r = get_recipe(name)
        assert r.name == name
        for fmt in r.formats:
            assert get_recipe(name, fmt=fmt).block == (16 if fmt == "nvfp4" else 32)
    with pytest.raises(ValueError, match="allowed: mxfp4"):
        get_recipe("quartet", fmt="nvfp4")
    with pytest.raises(ValueError, match="no hardware model"):
        get_recipe("nvidia_fp4", accumulate="b200")
    with pytest.raises(ValueError, match="has no field"):
        get_recipe("quartet2", block=32)
    with pytest.raises(ValueError, match=r"unknown recipe 'quartet3'; allowed: .*quartet2"):
        get_recipe("quartet3")


def test_sizes_that_are_not_multiples_of_the_block_need_pad():
    x, w, _ = _data(k=40)
    with pytest.raises(ValueError, match="pass pad=True"):
        matmul(x, w, recipe=get_recipe("fp4_all_the_way"), key=jax.random.PRNGKey(0))
    y = matmul(x, w, recipe=get_recipe("fp4_all_the_way", pad=True), key=jax.random.PRNGKey(0))
    assert y.shape == (64, 64)
    x, w, _ = _data()
    with pytest.raises(ValueError, match="needs a PRNG key"):
        jax.grad(lambda w: jnp.sum(matmul(x, w, recipe="nvidia_fp4")))(w)


# --- forwards: the quantizers the papers name ----------------------------------------------
def test_nvidia_forward_is_the_nvfp4_recipes_forward_bit_for_bit():
    x, w, _ = _data()
    a = np.asarray(matmul(x, w, recipe="nvidia_fp4")).view(np.int32)
    b = np.asarray(matmul(x, w, recipe="nvfp4")).view(np.int32)
    # the same quantized operands and float32 products; the two per-tensor decode scales are
    # applied to the output one after the other here and as one product there: 1 ulp at most
    assert np.max(np.abs(a - b)) <= 1 and np.mean(a == b) > 0.5


@pytest.mark.slow  # six recipes' forwards; the nvidia test above is the cheap one
def test_forwards_are_the_named_quantizers_composed():
    x, w, _ = _data()
    wt = w.T  # (N, K): blocks along K, as the fprop contracts

    def ref(qx, qw):
        return np.asarray(_hp(qx, qw.T))

    cases = {
        "tseng_fp4": ref(_bf16(x), _bf16(wt)),
        "quartet": ref(fake_quant(x, "quest"), fake_quant(wt, "quest")),
        "quartet2": ref(fake_quant(x, "nvfp4"), fake_quant(wt, "nvfp4")),
        "fp4_all_the_way": ref(fake_quant(x, "nvfp4"), fake_quant(wt, "nvfp4")),
        "four_over_six": ref(
            fp4.nvfp4(x, scale_max=256.0, four_over_six="mse").values(),
            fp4.nvfp4(wt, two_d=True, scale_max=256.0, four_over_six="mse").values(),
        ),
        "tetrajet_v2": ref(fp4.nvfp4(x, outer=64).values(), fp4.nvfp4(wt, outer=64).values()),
    }
    for name, want in cases.items():
        got = np.asarray(matmul(x, w, recipe=name))
        assert np.allclose(got, want, rtol=2e-5, atol=2e-5), name


# --- backwards ------------------------------------------------------------------------------
def _mean_backward(name, fmt=None, draws=128):
    x, w, g = _data()
    r = get_recipe(name, **({"fmt": fmt} if fmt else {}))
    f = jax.jit(jax.vmap(lambda k: _vjp(r, x, w, g, k)[1:]))
    dx, dw = f(jax.random.split(jax.random.PRNGKey(1), draws))
    return x, w, g, np.asarray(dx, np.float64), np.asarray(dw, np.float64)


def _rel_bias(draws, ref):
    """(relative bias norm, relative standard error of the mean) of the draws against ref."""
    n = draws.shape[0]
    m = draws.mean(0)
    var = float(np.sum(draws.var(0, ddof=1)))
    b2 = float(np.sum((m - ref) ** 2)) - var / n
    rr = float(np.sum(ref**2))
    return np.copysign(np.sqrt(abs(b2) / rr), b2), np.sqrt(var / n / rr)


@pytest.mark.slow  # 128 draws of a backward per recipe
@pytest.mark.parametrize(
    ("name", "fmt"),
    [("tseng_fp4", "mxfp4"), ("tseng_fp4", "nvfp4"), ("fp4_all_the_way", "nvfp4")],
)
def test_backwards_of_high_precision_operands_are_unbiased(name, fmt):
    """Tseng et al. (3/4 pre-scale, or NVFP4's 16/17 headroom) and FP4 All the Way quantize
    the backward's operands from high precision with stochastic rounding: the mean of 128
    backwards is the high-precision gradient, to 3 standard errors (99.7%)."""
    x, w, g, dx, dw = _mean_backward(name, fmt)
    for draws, ref in ((dx, np.asarray(g @ w.T, np.float64)), (dw, np.asarray(x.T @ g))):
        bias, se = _rel_bias(draws, ref)
        assert abs(bias) < 3 * se, (bias, se)


@pytest.mark.slow
def test_fp4_all_the_way_on_mxfp4_is_biased_by_clipping():
    """The OCP floor scale lets stochastic rounding clip a block's largest elements (the
    documented choice): its mean backward is measurably biased (> 3 standard errors over 512
    draws; measured 0.055 of the norm)."""
    _, w, g, dx, _ = _mean_backward("fp4_all_the_way", "mxfp4", draws=512)
    bias, se = _rel_bias(dx, np.asarray(g @ w.T, np.float64))
    assert bias > 3 * se, (bias, se)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["quartet2", "tetrajet_v2"])
def test_backwards_of_the_forward_quantized_operands_are_unbiased_for_them(name):
    """Quartet II (MS-EDEN) and TetraJet-v2 (SR) re-quantize the forward's quantized operands:
    the mean backward is the gradient of the quantized forward (not of the high-precision
    one): relative bias below 1% of the norm (MS-EDEN's bias is of that order, see
    tests/quant/test_fp4_quant.py), while the high-precision gradient is ~10% away."""
    x, w, g, dx, dw = _mean_backward(name)
    if name == "quartet2":
        qx, qw = fake_quant(x, "nvfp4"), fake_quant(w.T, "nvfp4").T
    else:
        qx, qw = fp4.nvfp4(x, outer=64).values(), fp4.nvfp4(w.T, outer=64).values().T
    for draws, ref, hp in ((dx, g @ qw.T, g @ w.T), (dw, qx.T @ g, x.T @ g)):
        bias, _ = _rel_bias(draws, np.asarray(ref, np.float64))
        bias_hp, _ = _rel_bias(draws, np.asarray(hp, np.float64))
        assert abs(bias) < 0.01 and bias_hp > 0.05, (bias, bias_hp)


def test_nvidia_backward_rotates_only_the_wgrad_and_reuses_the_2d_weight():
    """dgrad: SR(g) times the 16 x 16-tile weight of the forward; wgrad: the 16-point Hadamard
    transform of both operands. With SR turned into RTN by a zero-width test (g on the grid),
    dx equals g times the tiled weight exactly."""
    x, w, _ = _data()
    # a gradient already on the E2M1 grid with one amax per block: SR leaves it unchanged
    g = jnp.asarray(np.tile(np.array([6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0] * 2,
                                      np.float32), (64, 4)))  # fmt: skip
    _, dx, dw = _vjp(get_recipe("nvidia_fp4"), x, w, g, jax.random.PRNGKey(0))
    qw = fp4.nvfp4(w.T, two_d=True).values().T  # (K, N)
    assert np.allclose(np.asarray(dx), np.asarray(_hp(g, qw.T)), rtol=1e-5, atol=1e-5)
    # wgrad differs from the unrotated product of the same quantizers: the transform is there
    plain = _hp(fp4.nvfp4(g.T).values(), fp4.nvfp4(x.T).values().T).T
    assert not np.allclose(np.asarray(dw), np.asarray(plain), rtol=1e-3)


@pytest.mark.parametrize(
    "name", ["tseng_fp4", *(pytest.param(n, marks=pytest.mark.slow) for n in ("quartet2",
                                                                            "tetrajet_v2"))]
)  # fmt: skip
def test_stochastic_backwards_change_with_the_key_and_forwards_do_not(name):
    x, w, g = _data()
    if True:
        r = get_recipe(name)
        y1, dx1, _ = _vjp(r, x, w, g, jax.random.PRNGKey(1))
        y2, dx2, _ = _vjp(r, x, w, g, jax.random.PRNGKey(2))
        assert np.array_equal(np.asarray(y1), np.asarray(y2)), name
        assert not np.array_equal(np.asarray(dx1), np.asarray(dx2)), name


# --- state: Q-EMA and OutControl -------------------------------------------------------------
def _dense(p, x):
    return jnp.sum(jnp.square(x @ p["w"]))


def test_tetrajet_q_ema_state_counts_averages_and_rounds():
    x, w, _ = _data()
    r = get_recipe("tetrajet", ema_warmup=2)
    f = apply(_dense, r)
    params = {"w": w}
    state = f.init_state(params, x)
    (site,) = state
    assert set(state[site]) == {"ema", "count", "probe"}
    vg = f.value_and_grad()
    key = jax.random.PRNGKey(0)
    _, _, obs = vg(state, params, x, key=key)
    s1 = f.update_state(state, obs)
    assert float(s1[site]["count"]) == 1.0
    assert np.array_equal(np.asarray(s1[site]["ema"]), np.asarray(w))  # first: the weight
    w2 = {"w": w * 1.01}
    _, _, obs = vg(s1, w2, x, key=key)
    s2 = f.update_state(s1, obs)
    want = 0.9972 * w + (1 - 0.9972) * w * 1.01
    assert np.allclose(np.asarray(s2[site]["ema"]), np.asarray(want), rtol=1e-6)
    # once warmed up, the forward rounds the weight towards its average: an average far away
    # (the weight's negative) moves every element that is not on the grid
    far = {**s2, site: {**s2[site], "ema": -s2[site]["ema"], "count": jnp.float32(5)}}
    plain = f(params, x, state={**s2, site: {**s2[site], "count": jnp.float32(0)}}, key=key)
    moved = f(params, x, state=far, key=key)
    assert float(plain) != float(moved)


def test_tetrajet_v2_outcontrol_ranks_channels_and_switches_them_to_fp8():
    x, w, _ = _data()
    x = x.at[:, 10:16].multiply(50.0)  # 6 outlier channels = round(0.1 * 64)
    r = get_recipe("tetrajet_v2", outlier_start=1, outlier_iters=2)
    f = apply(_dense, r)
    params = {"w": w}
    state = f.init_state(params, x)
    (site,) = state
    vg = f.value_and_grad()
    key = jax.random.PRNGKey(0)
    losses = []
    for _ in range(4):
        loss, _, obs = vg(state, params, x, key=key)
        losses.append(float(loss))
        state = f.update_state(state, obs)
    norms = np.asarray(state[site]["norm"])  # (K, N): channel norms along K, summed twice
    order = np.argsort(-norms[:, 0], kind="stable")
    assert set(order[:6].tolist()) == set(range(10, 16))
    assert float(state[site]["count"]) == 4.0
    # steps 0-2 quantize every channel in NVFP4; step 3 (count 3 >= 1 + 2) the outliers in
    # MXFP8: closer to the high-precision loss
    hp = float(jnp.sum(jnp.square(_hp(x, w))))
    assert losses[0] == losses[1] == losses[2]
    assert abs(losses[3] - hp) < abs(losses[2] - hp)


# --- OsciReset --------------------------------------------------------------------------------
def test_osci_reset_snaps_oscillating_weights_to_their_quantized_value():
    # element 0 hops across a rounding boundary of Q = round to integers (the master weight
    # moves by 0.02, its quantized value by 1: ratio 50); element 1 drifts steadily
    q = jnp.round
    tx = osci_reset(q, start=0, period=4, track=2, threshold=8.0, mask={"w": True})
    params = {"w": jnp.array([0.49, 3.3], jnp.float32)}
    state = tx.init(params)
    seq = [jnp.array([0.0, 0.0]), jnp.array([0.02, 0.1]), jnp.array([-0.02, 0.1]),
           jnp.array([0.02, 0.1]), jnp.array([0.0, 0.1])]  # fmt: skip
    # updates 1-3: no window yet; 4: reference; 5-6 tracked; 7: reset
    history = []
    for i in range(8):
        u = {"w": seq[min(i, 4)] if i < 4 else jnp.array([0.02 if i % 2 else -0.02, 0.1])}
        u2, state = tx.update(u, state, params)
        params = optax.apply_updates(params, u2)
        history.append(np.asarray(params["w"]).tolist())
    w0_before, w1_before = history[5]
    w0, w1 = history[6]
    assert w0 == round(w0_before + 0.02) or w0 == round(w0_before - 0.02)  # snapped: integer
    assert float(w0).is_integer() and not float(w0_before).is_integer()
    assert abs(w1 - (w1_before + 0.1)) < 1e-6  # the steady one moved as the optimizer said


def test_osci_reset_leaves_unselected_params_and_needs_params():
    tx = osci_reset(jnp.round, start=0, period=2, track=1, mask={"w": False, "b": True})
    p = {"w": jnp.ones(3), "b": jnp.ones(3)}
    st = tx.init(p)
    assert st.prev["w"].shape == ()  # no state for an unselected leaf
    with pytest.raises(ValueError, match="needs the params"):
        tx.update(p, st)


# --- training ----------------------------------------------------------------------------------
@pytest.mark.slow  # one compiled train step per recipe
@pytest.mark.parametrize("name", FP4)
def test_every_recipe_trains_the_transformer_and_differs_from_bf16(name):
    from precisionlab.train import TrainConfig, train

    base = dict(model="transformer", data="text", data_kwargs={"seq_len": 32, "max_bytes":
                200000}, model_kwargs={"d_model": 32, "depth": 1, "heads": 2}, steps=3,
                batch_size=4, policy="p=f32,c=bf16,o=f32", progress=False)  # fmt: skip
    ref = train(TrainConfig(**base), quiet=True)
    got = train(TrainConfig(**base, recipe={"name": name, "include": [0, 3, 4, 5]}), quiet=True)
    assert np.isfinite(got.final_loss) and got.final_loss != ref.final_loss
    if get_recipe(name).stateful:
        rs = got.state.recipe_state
        assert rs and all(float(v["count"]) == 3.0 for v in rs.values() if v)


def test_fp4_recipes_are_frozen_and_hashable():
    r = get_recipe("quartet2")
    assert hash(r) == hash(get_recipe("quartet2"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.hadamard_size = 64  # type: ignore[misc]
