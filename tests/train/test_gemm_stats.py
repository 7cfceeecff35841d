"""Gradient statistics per GEMM (precisionlab.train.gemm_stats): the estimators on hand-made
sums, and the measurement's effect on a deterministic and a stochastic recipe."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from precisionlab.mixed._loss_scale import NoLossScale
from precisionlab.train._hooks import StepEnd
from precisionlab.train._recipe import parse_recipe
from precisionlab.train.gemm_stats import (
    GEMMS,
    SQRT3,
    GemmStatsHook,
    _stats_of,
    gemm_rows,
    make_gemm_stats_fn,
)


def test_estimators_on_hand_computed_sums():
    # H = (3, 4) (||H||^2 = 25); draws Q1 = (3, 5), Q2 = (3, 3): Q1 - Q2 = (0, 2) -> 4;
    # mean (3, 4) = H -> 0; <Q1, H> = 29; ||Q1||^2 = 34; mean squared error (1 + 1) / 2 = 1
    h, q1, q2 = np.array([3.0, 4.0]), np.array([3.0, 5.0]), np.array([3.0, 3.0])
    sums = np.array([25.0, 4.0, 0.0, 29.0, 34.0, 1.0])
    s = _stats_of(sums)
    assert s["norm"] == 5.0
    assert s["rel_var"] == pytest.approx(2.0 / 25)  # ||Q1-Q2||^2 / 2 = total variance 2
    # bias^2 = ||mean - H||^2 - var/2 = 0 - 1 < 0: an unbiased pair reads slightly negative
    assert s["rel_bias"] == pytest.approx(-math.sqrt(1.0 / 25))
    assert s["cosine"] == pytest.approx(29 / math.sqrt(34 * 25))
    assert s["ratio"] == pytest.approx(5.0)
    from precisionlab.train.gemm_stats import _sums

    assert np.allclose(np.asarray(_sums(jnp.asarray(h), jnp.asarray(q1), jnp.asarray(q2))), sums)
    # a deterministic biased quantizer: Q1 = Q2 = 1.1 H: bias 0.1, no variance, ratio 10
    det = np.array([25.0, 0.0, 0.25, 27.5, 30.25, 0.25])
    d = _stats_of(det)
    assert d["rel_var"] == 0 and d["rel_bias"] == pytest.approx(0.1)
    assert d["ratio"] == pytest.approx(10.0) and d["ratio"] > SQRT3


def test_rows_per_matmul_and_gemm_plus_all():
    sums = np.zeros((2, 3, 6))
    sums[..., 0] = 4.0
    sums[..., 5] = 1.0
    rows = gemm_rows(sums, ["dot_general[0]", "dot_general[3]"], step=7)
    assert len(rows) == 2 * 3 + 3
    assert [r["gemm"] for r in rows[-3:]] == list(GEMMS)
    assert rows[-1]["site"] == "all" and rows[-1]["ratio"] == pytest.approx(2.0)
    assert all(r["step"] == 7 for r in rows)


def _model():
    def loss(p, b):
        h = jnp.tanh(b["x"] @ p["w1"])
        return jnp.mean(jnp.square(h @ p["w2"] - b["y"]))

    k = jax.random.split(jax.random.PRNGKey(0), 4)
    p = {"w1": jax.random.normal(k[0], (64, 64)) / 8, "w2": jax.random.normal(k[1], (64, 32)) / 8}
    b = {"x": jax.random.normal(k[2], (64, 64)), "y": jax.random.normal(k[3], (64, 32))}
    return loss, p, b


@pytest.fixture(scope="module")
def measured():
    """Sums of a deterministic reference (bf16) and an SR recipe on the same two-layer model."""
    loss, p, b = _model()
    out = {}
    for name in ("bf16", "fp4_all_the_way"):
        fn, names = make_gemm_stats_fn(loss, parse_recipe(name))
        sums = jax.jit(fn)(p, b, NoLossScale(), {}, jax.random.PRNGKey(1))
        out[name] = {r["gemm"] + "/" + r["site"]: r for r in gemm_rows(sums, names(p, b,
                     NoLossScale()), 1)}  # fmt: skip
    return out


def test_a_deterministic_recipe_has_no_variance_and_bf16_is_close(measured):
    rows = measured["bf16"]
    assert {k.split("/")[1] for k in rows} == {"dot_general[0]", "dot_general[1]", "all"}
    for r in rows.values():
        assert r["rel_var"] == 0.0
        assert r["cosine"] > 0.9999 and abs(r["rel_bias"]) < 0.01 and r["ratio"] > 100


def test_stochastic_backward_shows_variance_only_where_it_rounds_stochastically(measured):
    rows = measured["fp4_all_the_way"]
    assert rows["fprop/all"]["rel_var"] == 0.0  # RTN forward: deterministic
    for g in ("dgrad", "wgrad"):
        r = rows[f"{g}/all"]
        assert 1e-4 < r["rel_var"] < 0.1  # SR: two draws differ
        # FP4 All the Way's backward is unbiased: the bias estimate is within the noise
        assert abs(r["rel_bias"]) < 3 * math.sqrt(r["rel_var"] / 2)
        assert 0.9 < r["cosine"] < 0.9999 and 2 < r["ratio"] < 100


def test_the_hook_measures_every_interval_on_the_states_it_is_given():
    loss, p, b = _model()
    got = []

    class State:
        params, loss_scale, recipe_state, values = p, NoLossScale(), {}, None
        rng = jax.random.PRNGKey(0)

    from precisionlab.mixed._policy import Policy

    hook = GemmStatsHook(loss, parse_recipe("bf16"), Policy(), lambda s: b, 2, got.append)
    for step in (1, 2, 3, 4):
        hook.on_step(StepEnd(step, 4, {}, State() if step != 4 else None, None, step == 4))
    assert len(got) == 1 and got[0][0]["step"] == 2  # step 4 had no state: skipped
    with pytest.raises(ValueError, match="interval"):
        GemmStatsHook(loss, parse_recipe("bf16"), Policy(), lambda s: b, 0, got.append)


def test_a_convolution_is_measured_on_its_three_gemms():
    """gemm_stats taps a convolution: its fprop, dgrad and wgrad sums are those of the same
    products computed by lax (HIGHEST) and by the recipe's quantized convolution
    (recipes.conv_general_dilated), forward and backward. Convolutions used to be left out,
    silently."""
    from precisionlab import recipes
    from precisionlab.train.gemm_stats import _sums

    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((2, 4, 7, 6)).astype(np.float32))
    k = jnp.asarray(rng.standard_normal((6, 2, 3, 2)).astype(np.float32))
    conv = dict(window_strides=(2, 1), padding=((1, 1), (0, 1)), feature_group_count=2)
    cot = jnp.asarray(rng.standard_normal((2, 6, 4, 6)).astype(np.float32))

    def loss(p, b):
        return jnp.sum(jax.lax.conv_general_dilated(b["x"], p["k"], **conv) * cot)

    fn, names = make_gemm_stats_fn(loss, parse_recipe("current"))
    p, b = {"k": k}, {"x": x}
    assert names(p, b, NoLossScale()) == ["conv_general_dilated[0]"]
    got = np.asarray(jax.jit(fn)(p, b, NoLossScale(), {}, jax.random.PRNGKey(1)))[0]

    def high(x, k):
        return jax.lax.conv_general_dilated(x, k, **conv, precision=jax.lax.Precision.HIGHEST)

    def quantized(x, k):
        return recipes.conv_general_dilated(x, k, **conv, recipe="current")

    yh, vjp_h = jax.vjp(high, x, k)
    yq, vjp_q = jax.vjp(quantized, x, k)
    (dxh, dkh), (dxq, dkq) = vjp_h(cot), vjp_q(cot)
    want = np.stack([_sums(yh, yq, yq), _sums(dxh, dxq, dxq), _sums(dkh, dkq, dkq)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=0)
    rows = {r["gemm"]: r for r in gemm_rows(got[None], names(p, b, NoLossScale()), 0)[:3]}
    for r in rows.values():  # deterministic, and off the high-precision product
        assert r["rel_var"] == 0.0 and 1e-3 < r["rel_bias"] < 0.2
