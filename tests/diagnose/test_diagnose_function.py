"""diagnose on any function: compare (first crossing, ranking by contribution), bisect and
autoswitch on user functions (plain JAX, Flax NNX, Equinox), and the ranking of emulate.check.

Oracles independent of the attribution code:
- hand-built functions whose dominant rounding is known, recomputed op by op in numpy with
  ml_dtypes' float16 (one rounding per operation, as a float16 GPU kernel stores it): the
  difference to float32, and the difference with one operation kept in float32;
- for recipes, ``recipes.apply(..., exclude=...)``: the output with one matmul unquantized.
The top-ranked operation must be the one whose return to high precision shrinks the output's
difference most, and its predicted share must match the measured change.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from precisionlab import diagnose, recipes
from precisionlab.emulate import Side, attribute, check, emulate


def _h(x):
    """Round to float16 (numpy's IEEE binary16, one rounding from float64), in float64."""
    return np.asarray(np.asarray(x, np.float64).astype(np.float16), np.float64)


def _cancel(x, c):
    return (x + c) - c


X = np.random.default_rng(0).standard_normal(256).astype(np.float32)
C = np.float32(1000.0)  # an argument: XLA (and emulate) would fold a literal


@pytest.fixture(scope="module")
def cancel():
    return diagnose.compare(_cancel, (X, C), candidate="c=f16")


def test_cancellation_is_ranked_first_and_its_share_is_measured(cancel):
    x = X.astype(np.float64)
    cand = _h(_h(_h(x) + 1000.0) - 1000.0)  # every operation rounded to float16
    keep_add = _h((np.float32(_h(X)) + C).astype(np.float64) - 1000.0)  # add in float32
    keep_sub = _h(_h(_h(x) + 1000.0) - 1000.0)  # sub of float16 values: exact anyway
    d = np.linalg.norm(cand - x)
    assert cancel.output_rel == pytest.approx(d / np.linalg.norm(x), rel=1e-3)
    top = cancel.ranked()[0]
    assert top.name == "add[0]"
    shrink = {
        "add[0]": d - np.linalg.norm(keep_add - x),
        "sub[0]": d - np.linalg.norm(keep_sub - x),
    }
    assert max(shrink, key=shrink.get) == top.name
    assert cancel.share(top) == pytest.approx(1.0, abs=0.02)  # it is the whole difference
    # add's result differs by 2e-4 (relative), sub's by ~0.14: the first tensor over 0.1
    assert cancel.first is not None and cancel.first.name == "sub[0]"
    assert cancel.first.rel == pytest.approx(d / np.linalg.norm(x), rel=1e-3)
    assert "add[0]" in cancel.summary()


def _amplified(x, c, k):
    return (jnp.exp(x) - c) * k + jnp.sin(x) * 0.5


def test_the_amplified_rounding_wins_and_prediction_matches_the_measured_change():
    x = np.linspace(0.5, 0.6, 64, dtype=np.float32)
    c = np.float32(np.exp(0.55))
    k = np.float32(300.0)
    res = diagnose.compare(_amplified, (x, c, k), candidate="c=f16")
    x64 = x.astype(np.float64)
    ref = (np.exp(x64) - c) * 300.0 + np.sin(x64) * 0.5

    def run(keep: str | None) -> np.ndarray:
        """float16 op by op: operands rounded, each result rounded once; the operation
        ``keep`` in float32 on the operands it receives, its result passed on unrounded."""
        c64 = np.float64(c)
        e = np.exp(x64) if keep == "exp" else _h(np.exp(_h(x64)))
        s = e - c64 if keep == "sub" else _h(e - _h(c64))
        m = s * 300.0 if keep == "mul" else _h(s * 300.0)
        sn = np.sin(x64) if keep == "sin" else _h(np.sin(_h(x64)))
        m2 = sn * 0.5 if keep == "mul1" else _h(sn * 0.5)
        return _h(m + m2)

    cand = run(None)
    d = cand - ref
    assert np.linalg.norm(d) / np.linalg.norm(ref) == pytest.approx(res.output_rel, rel=0.05)
    names = {"exp": "exp[0]", "sub": "sub[0]", "mul": "mul[0]", "sin": "sin[0]", "mul1": "mul[1]"}
    shrink = {names[k]: np.linalg.norm(d) - np.linalg.norm(run(k) - ref) for k in names}
    top = res.ranked()[0]
    assert top.name == "exp[0]" == max(shrink, key=shrink.get)
    # predicted (first order) against measured: the change along the difference's direction
    w = d / np.linalg.norm(d)
    measured = float(w @ (cand - run("exp")))
    assert top.contribution == pytest.approx(measured, rel=0.25)
    assert res.attribution.explained == pytest.approx(1.0, abs=0.2)


def test_overflow_is_ranked_by_the_operation_that_makes_the_infinity():
    def f(x):
        return jnp.sum(jnp.exp(x) / jnp.exp(x) * x)

    x = np.linspace(-12, 12, 64, dtype=np.float32)  # exp(12) = 162755 > 65504
    res = diagnose.compare(f, (x,), candidate="c=f16")
    over = int(np.sum(x > np.log(65504)))
    top = res.ranked()[0]
    assert top.name == "exp[0]" and top.new_nonfinite == over
    assert res.output_rel == np.inf
    assert res.first is not None and res.first.name == "exp[0]"
    assert "turns 3 values inf/NaN" in res.summary()


def test_recipe_ranking_agrees_with_excluding_each_matmul():
    k = jax.random.split(jax.random.key(0), 3)
    w1 = jax.random.normal(k[0], (32, 64)) / 6
    w2 = (jax.random.normal(k[1], (64, 16)) / 8).at[:, 0].multiply(300.0)  # an outlier column
    x = jax.random.normal(k[2], (8, 32))

    def f(w, x):  # the parameters first, so both matmuls multiply a weight
        return jnp.tanh(x @ w[0]) @ w[1]

    res = diagnose.compare(f, ((w1, w2), x), candidate="current")
    ref = np.asarray(f((w1, w2), x), np.float64)

    def quantized(exclude=()):
        return np.asarray(jax.jit(recipes.apply(f, "current", exclude=exclude))((w1, w2), x))

    d = np.linalg.norm(quantized() - ref)
    shrink = {
        n: d - np.linalg.norm(quantized(n) - ref) for n in ("dot_general[0]", "dot_general[1]")
    }
    ranked = [o.name for o in res.ranked()]
    assert sorted(ranked) == ["dot_general[0]", "dot_general[1]"]  # tanh: computed as written
    assert ranked[0] == max(shrink, key=shrink.get)
    assert res.output_rel == pytest.approx(d / np.linalg.norm(ref), rel=1e-3)


class _NNXMLP(nnx.Module):  # as flax's docs write a model
    def __init__(self, rngs: nnx.Rngs, gain: float = 1.0):
        self.fc1 = nnx.Linear(16, 32, use_bias=False, rngs=rngs)
        self.fc1.kernel[...] = self.fc1.kernel[...] * gain
        self.fc2 = nnx.Linear(32, 4, rngs=rngs)
        self.gain = gain

    def __call__(self, x):
        return self.fc2(nnx.gelu(self.fc1(x) * (1.0 / self.gain)))


def test_flax_nnx_model_compare():
    x = jax.random.normal(jax.random.key(1), (8, 16))
    graphdef, state = nnx.split(_NNXMLP(nnx.Rngs(0)))

    def fwd(state, x):
        return nnx.merge(graphdef, state)(x)

    res = diagnose.compare(fwd, (state, x), candidate="c=bf16")
    assert res.first is None and 0 < res.output_rel < 0.05
    assert res.attribution.explained == pytest.approx(1.0, abs=0.2)
    assert res.ranked()[0].name in ("dot_general[0]", "dot_general[1]", "add[0]")


@pytest.mark.slow  # ~17 CPU s: six compiles of the bisection
def test_flax_nnx_model_bisect_finds_the_one_culprit():
    # fc1's output is 1e5 times too large for float16, rescaled right after: one culprit
    x = jax.random.normal(jax.random.key(1), (8, 16))
    graphdef, state = nnx.split(_NNXMLP(nnx.Rngs(0), gain=1e5))

    def fwd(state, x):
        return nnx.merge(graphdef, state)(x)

    res = diagnose.compare(fwd, (state, x), candidate="c=f16")
    assert res.first.name == "dot_general[0]" and res.first.rel == np.inf
    assert res.ranked()[0].name == "dot_general[0]" and res.ranked()[0].new_nonfinite > 0
    b = diagnose.bisect(fwd, (state, x), candidate="c=f16", tolerance=0.05)
    assert b.answer == ("dot_general[0]",)
    assert b.runs[0].label == "reference" and b.runs[0].loss == np.inf
    assert b.search_runs <= b.budget


def test_autoswitch_pads_a_named_block_recipe_as_recipes_apply_does():
    """A 10-class head contracts over 10 in its data gradient, 27 features in its forward: a
    block recipe named by the user pads them (as ``recipes.apply`` does); a Recipe object
    given with ``pad=False`` is taken as it is and refuses them."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((27, 10)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((8, 27)), jnp.float32)

    def loss(w, x):
        return jnp.mean((x @ w) ** 2)

    sw = diagnose.autoswitch(loss, (w, x), recipe="mxfp8", underflow=1.0, mse=1e30)
    assert [r["site"] for r in sw.sites] == ["dot_general[0]"] and not sw.switched_sites
    assert 0 < sw.sites[0]["stats"]["x_mse"] < 1e-2  # measured, not zero
    with pytest.raises(ValueError, match="not a multiple of the block size 32"):
        diagnose.autoswitch(loss, (w, x), recipe=recipes.get_recipe("mxfp8"))


def test_equinox_model_compare_and_autoswitch():
    mlp = eqx.nn.MLP(8, 3, 16, depth=1, key=jax.random.key(0))
    params, static = eqx.partition(mlp, eqx.is_array)

    def fwd(params, x):
        return jax.vmap(eqx.combine(params, static))(x)

    x = jax.random.normal(jax.random.key(1), (4, 8))
    res = diagnose.compare(fwd, (params, x), candidate="c=f16")
    assert res.output_rel > 0 and res.ranked()[0].replaced

    def loss(params, x):
        return jnp.mean(fwd(params, x) ** 2)

    sw = diagnose.autoswitch(loss, (params, x), recipe="current", mse=0.0)  # everything trips
    assert sw.switched_sites == ["dot_general[0]", "dot_general[1]"]


@pytest.mark.slow  # ~10 CPU s: the H100 tensor-core model compiles slowly
def test_equinox_model_with_the_h100_model_and_nothing_switching():
    mlp = eqx.nn.MLP(8, 3, 16, depth=1, key=jax.random.key(0))
    params, static = eqx.partition(mlp, eqx.is_array)

    def fwd(params, x):
        return jax.vmap(eqx.combine(params, static))(x)

    def loss(params, x):
        return jnp.mean(fwd(params, x) ** 2)

    x = jax.random.normal(jax.random.key(1), (4, 8))
    em = emulate(fwd, "c=f16")  # the H100's tensor cores for the matmuls
    res = diagnose.compare(fwd, (params, x), candidate=em)
    assert res.candidate == "emulate c=float16, h100-xla" and res.output_rel > 0
    assert res.ranked()[0].replaced
    none = diagnose.autoswitch(loss, (params, x), recipe="current", mse=1.0, underflow=1.0)
    quantized = float(jax.jit(recipes.apply(loss, "current"))(params, x))
    assert none.switched_sites == [] and none.final_loss == pytest.approx(quantized, rel=1e-5)


def test_sides_and_bad_input():
    f = _cancel
    with pytest.raises(ValueError, match="unknown side 'nope'"):
        diagnose.compare(f, (X, C), candidate="nope")
    with pytest.raises(ValueError, match="keeps a train state"):
        diagnose.compare(f, (X, C), candidate="delayed")
    with pytest.raises(ValueError, match="wraps another function"):
        diagnose.compare(f, (X, C), candidate=emulate(lambda x, c: x, "c=f16"))
    with pytest.raises(ValueError, match="threshold must be a number > 0"):
        diagnose.compare(f, (X, C), candidate="c=f16", threshold=0)
    with pytest.raises(ValueError, match="ops pattern 'nothing' matches no operation"):
        diagnose.bisect(f, (X, C), candidate="c=f16", ops=("nothing",))
    with pytest.raises(TypeError, match="a side is"):
        Side.of(object(), f, (X, C))
    _, units = diagnose.load_units("experiments/broken_layer.toml", ["fp32", "fp16"])
    with pytest.raises(TypeError, match="unexpected keyword argument 'candidate'"):
        diagnose.compare(*units, candidate="c=f16")


def test_reference_may_be_a_policy_too(cancel):
    same = attribute(_cancel, (X, C), Side.of("c=f16", _cancel, (X, C)),
                     Side.of("c=f16", _cancel, (X, C)))  # fmt: skip
    assert same.output_norm == 0 and not same.ranked()
    res = diagnose.compare(_cancel, (X, C), reference="c=bf16", candidate="c=f16")
    assert res.reference == "c=bf16" and res.output_rel > 0


def test_emulate_check_ranks_where_fp16_departs_from_fp32():
    report = check(_amplified, "c=f16", np.linspace(0.5, 0.6, 64, dtype=np.float32),
                   np.float32(np.exp(0.55)), np.float32(300.0))  # fmt: skip
    assert report.ranking[0].site.name == "exp[0]"  # check's names: numbered over all ops
    assert "; most consequential: exp[0] (" in report.ranking_summary()
    lines = report.text().splitlines()
    assert lines[-2] == report.ranking_summary()  # the row summary stays the last line
    assert lines[-1].endswith(f"operations differ under c=f16; first: {report.differing[0].name}")
