"""The divergence predictors (issue 37, item 1): each signal against a hand-computed value on
a small tensor, and in the train step on a plain-JAX model written here (not a built-in one):
recorded on the due steps only, the training bitwise unchanged, and each state signal checked
against numpy on the same params, gradients and update.

Oracles: hand arithmetic; numpy on tensors computed outside the code under test; ml_dtypes'
float4_e2m1fn for the MX quantization of a LayerNorm weight.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from precisionlab._schema import ConfigError
from precisionlab.mixed._policy import get_policy
from precisionlab.train import LoopOptions, TrainConfig, train_loop
from precisionlab.train._predictors import (
    NOISE_THRESHOLD,
    SIGNALS,
    Predictors,
    kurtosis,
    ln_weight_bias,
    noise_ratio,
    parse_predictors,
    swiglu_alignment,
)
from precisionlab.train._step import StepOptions


def test_kurtosis_of_rows_by_hand():
    # row 1: mean(x^2) = 1, mean(x^4) = 1 -> 1; row 2: (16/4) / (4/4)^2 = 4; a zero row is left out
    x = jnp.array([[1.0, -1.0, 1.0, -1.0], [2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert float(kurtosis(x)) == pytest.approx(2.5)
    assert float(kurtosis(jnp.zeros((2, 3)))) == 0.0


def test_noise_ratio_ln_bias_and_alignment_by_hand():
    # ||(3, 4)|| = 5, error (0, 0.5): ratio 10; Chmiel et al.'s threshold is sqrt(3)
    assert float(noise_ratio(jnp.array([3.0, 4.0]), jnp.array([3.0, 4.5]))) == pytest.approx(10.0)
    assert float(noise_ratio(jnp.array([3.0, 4.0]), jnp.array([3.0, 4.0]))) == 1e6
    assert NOISE_THRESHOLD == pytest.approx(3**0.5)
    # g = (1, 2), Q(g) = (1.5, 2): sum((Q - g) g) / sum(g^2) = 0.5 / 5
    assert float(ln_weight_bias(jnp.array([1.0, 2.0]), jnp.array([1.5, 2.0]))) == pytest.approx(0.1)
    # columns: (1, 0) vs (0, 1) -> 0; (1, 1) vs (1, 0) -> 1/sqrt(2)
    gate = jnp.array([[1.0, 1.0], [0.0, 1.0]])
    up = jnp.array([[0.0, 1.0], [1.0, 0.0]])
    assert float(swiglu_alignment(gate, up)) == pytest.approx(2**-0.5)
    assert float(swiglu_alignment(gate, -gate)) == pytest.approx(1.0)  # anti-aligned counts


def test_ln_bias_under_mxfp4_matches_an_ml_dtypes_oracle():
    from precisionlab.quant import fake_quant

    g = np.linspace(0.8, 1.3, 32).astype(np.float32)  # a LayerNorm weight near 1
    # OCP MX (floor rule): X = 2^(floor(log2 amax) - emax(E2M1) = 2), elements g / X in E2M1
    scale = 2.0 ** (math.floor(math.log2(np.abs(g).max())) - 2)
    q = (g / scale).astype(ml_dtypes.float4_e2m1fn).astype(np.float32) * scale
    want = abs(float(np.sum((q - g) * g) / np.sum(g * g)))
    got = float(ln_weight_bias(jnp.asarray(g), fake_quant(jnp.asarray(g), "mxfp4", axis=-1)))
    assert want > 0.005 and got == pytest.approx(want, rel=1e-6)


def test_predictor_table_is_validated():
    assert parse_predictors(None, 100) is None
    assert parse_predictors({"enabled": False}, 100) is None
    p = parse_predictors({}, 1000)
    assert p.interval == 20 and not p.live and [s for s in range(12) if p.due(s)] == [0]
    assert parse_predictors({"interval": 3}, 1000).due(9)
    with pytest.raises(ConfigError, match="predictors: unknown key 'every'"):
        TrainConfig(predictors={"every": 3})
    with pytest.raises(ValueError, match="interval must be an int >= 1"):
        Predictors(interval=0)
    with pytest.raises(ValueError, match="unknown norm_format 'mxfp5'"):
        Predictors(interval=1, norm_format="mxfp5")


# --- in the train step, on a plain-JAX model ------------------------------------------------

D, H, C, B = 8, 16, 3, 12
LAYERS = (("l0", "['l0']"), ("l1", "['l1']"))


def _params():
    k = jax.random.split(jax.random.PRNGKey(3), 4)
    return {
        "l0": {
            "w_gate": jax.random.normal(k[0], (D, H)) / 3,
            "w_up": jax.random.normal(k[1], (D, H)) / 3,
            "ln_scale": jnp.ones((H,)) * 1.1,
        },
        "l1": {"w": jax.random.normal(k[2], (H, C)) / 4},
    }


def _loss(policy):
    pol = get_policy(policy)

    def loss_fn(p, batch):
        cd = pol.compute_dtype
        x = batch["x"].astype(cd)
        with jax.named_scope("l0"):
            h = jax.nn.silu(x @ p["l0"]["w_gate"].astype(cd)) * (x @ p["l0"]["w_up"].astype(cd))
            h = h * p["l0"]["ln_scale"].astype(cd)
        with jax.named_scope("l1"):
            logits = (h @ p["l1"]["w"].astype(cd)).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], 1))

    return loss_fn


def _batches(start=0):
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((B, D)).astype(np.float32) * 3 for _ in range(8)]
    ys = [rng.integers(0, C, B).astype(np.int32) for _ in range(8)]
    return iter([{"x": x, "y": y} for x, y in zip(xs, ys, strict=True)][start:])


def _run(policy, lr, predictors, steps=4):
    opts = StepOptions(policy=get_policy(policy), predictors=predictors)
    return train_loop(
        _loss(policy), _params(), optax.adam(lr), _batches, options=opts,
        loop=LoopOptions(steps=steps, chunk_steps=1, progress=False),
    )  # fmt: skip


@pytest.fixture(scope="module")
def fp32_runs():
    pred = Predictors(interval=2, layers=LAYERS, norm_format="mxfp4")
    return _run("p=f32,c=f32,o=f32", 1e-2, pred), _run("p=f32,c=f32,o=f32", 1e-2, None)


def test_recorded_on_due_steps_and_training_is_unchanged(fp32_runs):
    on, off = fp32_runs
    rows = [m.get("predictors") for m in on.metrics]
    assert [r["step"] if r else None for r in rows] == [1, None, 3, None]
    assert rows[0]["layers"][:2] == ["l0", "l1"] and set(rows[0]["signals"]) == set(SIGNALS)
    for a, b in zip(
        jax.tree.leaves(on.state.params), jax.tree.leaves(off.state.params), strict=True
    ):
        assert np.array_equal(np.asarray(a), np.asarray(b))  # recording changes no bit
    assert [m["loss"] for m in on.metrics] == [m["loss"] for m in off.metrics]


def test_step_one_signals_match_numpy_on_the_initial_state(fp32_runs):
    row = fp32_runs[0].metrics[0]["predictors"]
    sig = {s: dict(zip(row["layers"], v, strict=True)) for s, v in row["signals"].items()}
    p = jax.tree.map(np.asarray, _params())
    batch = next(_batches())
    x = batch["x"]
    # kurtosis of l0's linear inputs (both are x): FOG's per-row ratio, averaged
    k = np.mean(np.mean(x**4, 1) / np.mean(x**2, 1) ** 2)
    assert sig["kurtosis"]["l0"] == pytest.approx(k, rel=1e-5)
    # swiglu alignment of the initial gate and up columns
    g, u = p["l0"]["w_gate"], p["l0"]["w_up"]
    cos = np.sum(g * u, 0) / np.sqrt(np.sum(g * g, 0) * np.sum(u * u, 0))
    assert sig["swiglu_align"]["l0"] == pytest.approx(np.abs(cos).max(), rel=1e-5)
    # ln_bias of 1.1 in MXFP4: X = 2^(0 - 2), 1.1 / X = 4.4 -> 4 in E2M1: Q = 1.0, bias 1/11
    assert sig["ln_bias"]["l0"] == pytest.approx(abs(1.0 - 1.1) / 1.1, rel=1e-5)
    # gradient norms and the first Adam update (optax, outside the step)
    grads = jax.grad(_loss("p=f32,c=f32,o=f32"))(_params(), batch)
    upd, _ = optax.adam(1e-2).update(grads, optax.adam(1e-2).init(_params()), _params())
    for layer in ("l0", "l1"):
        gl = np.concatenate([np.ravel(v) for v in jax.tree.leaves(grads[layer])])
        ul = np.concatenate([np.ravel(v) for v in jax.tree.leaves(upd[layer])])
        wl = np.concatenate([np.ravel(v) for v in jax.tree.leaves(p[layer])])
        assert sig["grad_norm"][layer] == pytest.approx(np.linalg.norm(gl), rel=1e-5)
        assert sig["update_ratio"][layer] == pytest.approx(
            np.linalg.norm(ul) / np.linalg.norm(wl), rel=1e-4
        )
        assert sig["update_applied"][layer] == pytest.approx(1.0, abs=1e-5)  # float32 keeps it
    # float32 run: nothing near its range, no gradient below its smallest normal
    assert sig["headroom"]["l0"] > 100 and sig["grad_underflow"]["l1"] == 0.0
    assert sig["noise_ratio"]["l1"] == 1e6  # a float32 gradient is not rounded
    assert sig["q_underflow"]["l0"] == 0.0 == sig["q_mse"]["l0"]  # no recipe: no switch


def test_bf16_params_swamp_small_updates_and_fp16_headroom_is_its_range():
    # lr 1e-6 is far below half a bfloat16 ulp of weights ~0.3 (2^-10): every update is lost
    pred = Predictors(interval=1, layers=LAYERS)
    res = _run("p=bf16,c=bf16,o=f32", 1e-6, pred, steps=2)
    row = res.metrics[0]["predictors"]
    sig = {s: dict(zip(row["layers"], v, strict=True)) for s, v in row["signals"].items()}
    assert sig["update_applied"]["l0"] == 0.0 == sig["update_applied"]["l1"]
    assert sig["flip_rate"]["l1"] == 0.0  # the stored (compute-dtype) weights did not move
    # bfloat16 tensors: headroom = log2(bf16 max / amax) of l1's operands and output
    p = jax.tree.map(lambda v: np.asarray(v.astype(jnp.bfloat16), np.float32), _params())
    x = next(_batches())["x"].astype(ml_dtypes.bfloat16).astype(np.float32)
    h = jax.nn.silu(x @ p["l0"]["w_gate"]) * (x @ p["l0"]["w_up"]) * p["l0"]["ln_scale"]
    amax = max(np.abs(np.asarray(h)).max(), np.abs(p["l1"]["w"]).max())
    bf16_max = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    assert sig["headroom"]["l1"] == pytest.approx(math.log2(bf16_max / amax), abs=0.02)


def test_model_options_for_the_mechanisms_change_what_they_must():
    from precisionlab.train._models import make_model

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 9)), jnp.int32)
    base = make_model("transformer", d_model=32, depth=1, heads=2, seq_len=8)
    p = base.init(jax.random.PRNGKey(0))
    # norm weights of 1.1 and biases of 0.3: MXFP4 gives 1.0 and 0.25 (E2M1 steps) -> new logits
    p["blocks"][0]["ln1_scale"] = jnp.full((32,), 1.1)
    p["blocks"][0]["ln1_bias"] = jnp.full((32,), 0.3)
    quant = make_model("transformer", d_model=32, depth=1, heads=2, seq_len=8, norm_format="mxfp4")
    keep = make_model(
        "transformer", d_model=32, depth=1, heads=2, seq_len=8, norm_format="mxfp4",
        high_precision=("block0",),
    )  # fmt: skip
    plain = dict(
        p, blocks=[dict(p["blocks"][0], ln1_scale=jnp.ones(32), ln1_bias=jnp.full(32, 0.25))]
    )
    y_q = quant.apply(p, tokens[:, :-1])
    assert np.array_equal(np.asarray(y_q), np.asarray(base.apply(plain, tokens[:, :-1])))
    assert not np.array_equal(np.asarray(y_q), np.asarray(base.apply(p, tokens[:, :-1])))
    # a layer kept in high precision keeps its norm weights as they are
    hp = make_model(
        "transformer", d_model=32, depth=1, heads=2, seq_len=8, high_precision=("block0",)
    )
    assert np.array_equal(
        np.asarray(keep.apply(p, tokens[:, :-1])), np.asarray(hp.apply(p, tokens[:, :-1]))
    )
    # SwiGLU: gate and up projections instead of fc1 and its bias
    sw = make_model("transformer", d_model=32, depth=1, heads=2, seq_len=8, mlp="swiglu")
    blk = sw.init(jax.random.PRNGKey(0))["blocks"][0]
    assert {"w_gate", "w_up", "fc2"} <= set(blk) and "fc1" not in blk and "fc2_b" not in blk
    assert set(base.init(jax.random.PRNGKey(0))["blocks"][0]) >= {"fc1", "fc1_b", "fc2_b"}
    with pytest.raises(ValueError, match="unknown mlp 'relu'"):
        make_model("transformer", mlp="relu")
    with pytest.raises(ValueError, match="needs use_layernorm = true"):
        make_model("mlp", norm_format="mxfp4", width=64)


def test_flip_rate_counts_mxfp4_levels_not_scale_moves():
    from precisionlab.recipes import get_recipe
    from precisionlab.train._predictors import _qdq

    mx = get_recipe("mxfp4", pad=True)
    # one block of 32 along K: amax 6 sets the E8M0 scale 2^(2 - 2) = 1, so levels are E2M1's
    w0 = np.full((1, 32), 1.0, np.float32)
    w0[0, 0] = 6.0
    w1 = w0.copy()
    w1[0, 1] = 1.3  # 1.3 rounds to 1.5: one level flips
    w1[0, 2] = 1.2  # 1.2 rounds to 1.0: none
    codes = [np.asarray(_qdq(mx, jnp.asarray(w), "w", codes=True)) for w in (w0, w1)]
    assert np.sum(codes[0] != codes[1]) == 1 and codes[1][0, 1] == 1.5
    # the same weights scaled by 2 (a block scale step): every value moves, no level does
    c2 = np.asarray(_qdq(mx, jnp.asarray(w0 * 2), "w", codes=True))
    v0 = np.asarray(_qdq(mx, jnp.asarray(w0), "w"))
    v2 = np.asarray(_qdq(mx, jnp.asarray(w0 * 2), "w"))
    assert np.array_equal(c2, codes[0]) and np.array_equal(v2, 2 * v0)


def test_recipe_quantizer_of_the_te_statistics_matches_ml_dtypes():
    from precisionlab.recipes import get_recipe
    from precisionlab.train._predictors import _qdq

    rng = np.random.default_rng(5)
    x = (rng.standard_normal((3, 32)) * np.array([[1.0], [1e-3], [50.0]])).astype(np.float32)
    x[0, :4] = [1e-6, -1e-6, 0.0, 2.5]  # values MXFP4 flushes to zero, a zero, a normal one
    got = np.asarray(_qdq(get_recipe("mxfp4", pad=True), jnp.asarray(x), "x"))
    # OCP MX floor rule per row (one block of 32): X = 2^(floor(log2 amax) - 2), E2M1 elements
    scale = 2.0 ** (np.floor(np.log2(np.abs(x).max(axis=1, keepdims=True))) - 2)
    want = (x / scale).astype(ml_dtypes.float4_e2m1fn).astype(np.float32) * scale
    assert np.array_equal(got, want)
    # what q_underflow and q_mse are made of: flushed nonzeros, mean squared error
    flushed = np.sum((x != 0) & (want == 0)) / np.sum(x != 0)
    assert 0 < flushed < 1 and float(np.mean((x - want) ** 2)) > 0


def test_grad_underflow_is_every_cotangent_when_the_loss_is_weighted_away():
    # a float16 run whose loss is multiplied by 2^-40: every output cotangent flushes to zero
    pred = Predictors(interval=1, layers=LAYERS)
    opts = StepOptions(policy=get_policy("p=f32,c=f16,o=f32"), predictors=pred)
    res = train_loop(
        _loss("p=f32,c=f16,o=f32"), _params(), optax.adam(1e-3), _batches, options=opts,
        loop=LoopOptions(steps=1, chunk_steps=1, progress=False, loss_weight=2.0**-40),
    )  # fmt: skip
    row = res.metrics[0]["predictors"]
    sig = {s: dict(zip(row["layers"], v, strict=True)) for s, v in row["signals"].items()}
    assert sig["grad_underflow"]["l0"] == 1.0 == sig["grad_underflow"]["l1"]
    assert sig["noise_ratio"]["l1"] == 0.0  # the whole weight gradient is lost
    assert sig["grad_norm"]["l1"] == 0.0
