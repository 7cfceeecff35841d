"""precisionlab diagnose: layers kept in high precision, compare, bisect, autoswitch, bad input.

Oracles: the overflow knob is the identity in float32 (exact, a power-of-two scale), the
bisect search is checked against every position of a culprit with a stand-in runner, the
autoswitch statistics against ml_dtypes, and compare's underflow fractions against a numpy
recount of the dumped tensors. Real training runs of the acceptance checks that take more than
a few seconds on 2 cores are marked slow.
"""

from __future__ import annotations

import dataclasses
import io
import math
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import _im2col as im2col
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from precisionlab import diagnose as d
from precisionlab.cli import main
from precisionlab.experiments._config import Unit
from precisionlab.mixed._policy import get_policy
from precisionlab.train import TrainConfig, build
from precisionlab.train._models import make_model
from precisionlab.train._step import cast_compute

ROOT = Path(__file__).resolve().parents[2]
BROKEN = str(ROOT / "experiments" / "broken_layer.toml")
FP16 = str(ROOT / "experiments" / "fp16_vs_bf16.toml")


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        status = main(["diagnose", *argv])
    return status, out.getvalue(), err.getvalue()


# --- keeping layers in high precision ------------------------------------------------------
def test_overflow_knob_is_the_identity_in_float32_and_overflows_float16():
    plain = make_model("mlp", in_dim=8, width=16, depth=3)
    broken = dataclasses.replace(plain, overflow_layer=1)
    params = plain.init(jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 8))

    def run(model, policy, p):
        pol = get_policy(policy)
        return np.asarray(jax.jit(lambda p, x: model.apply(p, x, pol))(p, x))

    f32, f16 = "p=f32,c=f32,o=f32", "p=f32,c=f16,o=f32"
    np.testing.assert_array_equal(run(broken, f32, params), run(plain, f32, params))
    p16 = cast_compute(params, jnp.float16)
    assert not np.isfinite(run(broken, f16, p16)).all()
    # layer1 in float32: relu(z 2^20) 2^-20 == relu(z) exactly, then float16 again downstream
    kept = dataclasses.replace(broken, high_precision=("layer1",))
    cast = dataclasses.replace(plain, high_precision=("layer1",))
    np.testing.assert_array_equal(run(kept, f16, p16), run(cast, f16, p16))
    assert np.isfinite(run(kept, f16, p16)).all()


def test_every_layer_in_high_precision_is_the_float32_model_on_rounded_inputs():
    # conv (and the MLP under remat): with every layer kept in float32, a bfloat16 policy only
    # rounds the inputs at the boundary; the rest is the float32 computation, bit for bit.
    bf16, f32 = get_policy("p=f32,c=bf16,o=f32"), get_policy("p=f32,c=f32,o=f32")
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 16))
    x_bf = x.astype(jnp.bfloat16).astype(jnp.float32)
    for model in (
        make_model("conv", in_dim=16, width=4, depth=2),
        make_model("mlp", in_dim=16, width=8, depth=2, remat=True),
    ):
        params = model.init(jax.random.PRNGKey(0))
        hp = dataclasses.replace(model, high_precision=model.layer_names())
        got = jax.jit(lambda p, x, m=hp: m.apply(p, x, bf16))(params, x)
        want = jax.jit(lambda p, x, m=model: m.apply(p, x, f32))(params, x_bf)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_transformer_layers_are_named_scopes():
    from precisionlab.intercept import intercept

    class Keep:
        primitives = ("dot_general",)

        def apply(self, ctx, *ops, **params):
            return ctx.original(*ops)

    model = make_model("transformer", vocab_size=8, seq_len=4, d_model=8, depth=2, heads=2)
    tokens = jnp.zeros((2, 4), jnp.int32)
    sites = intercept(model.apply, Keep()).sites(model.param_shapes(), tokens)
    layers = [s.scope.split("/")[0] for s in sites]  # attention einsums: "block0/<spec>"
    # qkv, the two attention einsums, proj, fc1, fc2 per block; then the unembedding
    assert layers == ["block0"] * 6 + ["block1"] * 6 + ["unembed"]
    assert model.layer_names() == ("block0", "block1", "unembed")
    # the recipe exclusion of a block covers its attention products too
    cfg = TrainConfig(
        model="transformer",
        data="markov",
        recipe="current",
        high_precision_layers=["block1"],
        model_kwargs={"depth": 2, "d_model": 8, "heads": 2},
    )
    setup = build(cfg)
    batch = next(iter(setup.data.batches(2, seed=0)))
    pc = cast_compute(setup.params, jnp.float32)
    found = setup.options.recipe.apply(setup.loss_fn).sites(pc, batch)
    kept = {s.scope.split("/")[0] for s in found if not s.selected and not s.activations_only}
    assert kept == {"block1"}
    # besides block1's 6, block0's two attention products are kept: recipes leave products of
    # two activations in high precision unless attention = true (Transformer Engine's default)
    assert sum(not s.selected for s in found) == 8
    attn = [s.scope.split("/")[0] for s in found if s.activations_only]
    assert attn == ["block0", "block0", "block1", "block1"]


def test_high_precision_layers_resolve_globs_and_refuse_unmatched_ones():
    cfg = TrainConfig(model_kwargs={"depth": 3}, high_precision_layers=["layer[12]", "out"])
    assert cfg.high_precision == ("layer1", "layer2", "out")
    assert TrainConfig.from_dict(cfg.to_dict()).high_precision == cfg.high_precision
    with pytest.raises(ValueError, match=r"'block\*' matches no layer; layers: layer0, .*out"):
        TrainConfig(high_precision_layers=["block*"])
    t = TrainConfig(model="transformer", data="markov", high_precision_layers=["unembed"])
    assert t.high_precision == ("unembed",)


def test_high_precision_params_and_grads_stay_float32_and_leave_the_recipe():
    cfg = TrainConfig(
        model_kwargs={"depth": 2, "width": 16},
        policy="p=f32,c=bf16,o=f32",
        recipe="current",
        high_precision_layers=["layer1"],
    )
    setup = build(cfg)
    assert setup.options.fp32_params == ("['hidden'][1]",)
    pc = cast_compute(setup.params, jnp.bfloat16, setup.options.fp32_params)
    assert pc["hidden"][1]["w"].dtype == jnp.float32
    assert pc["hidden"][0]["w"].dtype == jnp.bfloat16
    assert setup.options.recipe.exclude == ("layer1/*",)
    batch = next(iter(setup.data.batches(8, seed=0)))
    sites = setup.options.recipe.apply(setup.loss_fn).sites(pc, batch)
    assert [(s.scope, s.selected) for s in sites] == [
        ("layer0", True),
        ("layer1", False),
        ("out", True),
    ]


# --- bisect: the search, with a stand-in runner -------------------------------------------
def _units(depth: int) -> tuple[Unit, Unit]:
    kw = {"model_kwargs": {"depth": depth, "width": 8}, "steps": 5}
    fail = TrainConfig(policy="p=f32,c=f16,o=f32", **kw)
    ok = TrainConfig(**kw)
    return (
        Unit("00-fail", "fail", "fail", "", "fail", 0, {}, fail),
        Unit("01-pass", "pass", "pass", "", "pass", 0, {}, ok),
    )


@pytest.mark.parametrize("culprits", [(i,) for i in range(8)] + [(1, 6), (2, 3)])
def test_bisect_finds_the_culprits_within_the_budget(culprits):
    fail, ok = _units(7)  # layer0..layer6 and out: 8 layers
    names = [f"layer{i}" for i in range(7)] + ["out"]
    bad = {names[i] for i in culprits}
    seen = []

    def runner(cfg, tail):
        seen.append(cfg.high_precision_layers)
        if cfg.policy == ok.config.policy:
            return 1.0
        return 1.0 if bad <= set(cfg.high_precision_layers) else math.inf

    r = d.bisect(fail, ok, d.BisectOptions(tolerance=0.0), runner=runner)
    assert set(r.answer) == bad
    assert len(r.runs) == len(seen) and r.search_runs == len(seen) - 2
    if len(bad) == 1:
        assert r.search_runs <= d.run_budget(8) == 4


def test_bisect_reports_a_variant_that_already_passes_and_none_when_nothing_helps():
    fail, ok = _units(3)
    r = d.bisect(fail, ok, runner=lambda cfg, tail: 1.0)
    assert r.answer == () and r.search_runs == 0
    never = d.bisect(
        fail, ok, runner=lambda cfg, tail: 1.0 if cfg.policy == ok.config.policy else math.inf
    )
    assert never.answer is None


# --- autoswitch statistics against ml_dtypes ------------------------------------------------
def test_autoswitch_statistics_match_an_ml_dtypes_recount():
    from precisionlab.diagnose._autoswitch import _qstats
    from precisionlab.recipes import get_recipe

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 16, 24)).astype(np.float32)
    x[0, :4] *= np.float32(2.0**-20)  # rows far below the tensor's amax: underflow in e4m3
    x[0, 5, 3] = 0.0
    stats = jax.jit(_qstats, static_argnums=(0, 2))
    got = np.asarray(stats(get_recipe("current"), jnp.asarray(x), "x", None))
    amax = np.abs(x).max()
    scale = np.float32(448.0 / np.float64(amax))
    elems = (x * scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    q = elems.astype(np.float64) / np.float64(scale)
    nz = x != 0
    assert got[0] == np.float32(np.sum(nz & (elems == 0)) / np.sum(nz))
    assert 0.1 < got[0] < 0.3
    np.testing.assert_allclose(got[1], np.mean((x - q) ** 2), rtol=1e-5)


def _rowwise_stats(rows: np.ndarray) -> tuple[float, float]:
    """(underflow, mse) of float32 rows under the rowwise recipe (tests/_im2col.py's recount);
    mse over every element, padding zeros included."""
    rows, elems, scale = im2col.rowwise_e4m3(rows)
    nz = rows != 0
    return np.sum(nz & (elems == 0)) / np.sum(nz), np.mean((rows - elems / scale) ** 2)


@pytest.mark.parametrize("grouped", [False, True])
def test_autoswitch_measures_a_convolution_as_its_gemm(grouped):
    """A convolution is measured on the GEMM the recipe runs: the patches (output positions x
    window taps and channels), the kernel rows and the output gradient with each group's
    output channels along the contraction, each recounted here from a numpy im2col; it
    switches like a matmul (the quantized output before, the convolution as written after)."""
    from precisionlab.diagnose import AutoSwitchRecipe
    from precisionlab.recipes import apply, get_recipe

    rng = np.random.default_rng(3)
    n, c, h, w, o, g = 2, 4, 7, 6, 6, (2 if grouped else 1)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    x[:, 1] *= np.float32(2.0**-20)  # a faint channel: underflows in each patch row
    k = rng.standard_normal((o, c // g, 3, 2)).astype(np.float32)
    strides, pads = (2, 1), ((1, 1), (0, 1))
    conv = dict(window_strides=strides, padding=pads, feature_group_count=g)
    ho, wo = im2col.out_size(h, 3, 2, pads[0]), im2col.out_size(w, 2, 1, pads[1])
    cot = rng.standard_normal((n, o, ho, wo)).astype(np.float32)  # the output's cotangent
    cot[:, 2] *= np.float32(2.0**-20)  # a faint output channel: underflows in each GEMM row

    def loss(p, x):  # d loss / d output = cot, whatever the forward computes
        return jnp.sum(jax.lax.conv_general_dilated(x, p, **conv) * cot)

    spec = AutoSwitchRecipe(get_recipe("rowwise"), underflow=1.0, mse=1e30)
    f = spec.apply(loss)
    state = f.init_state(k, x)
    assert list(state) == ["conv_general_dilated[0]"]
    observed = jax.jit(lambda st, p, x: f.value_and_grad()(st, p, x)[2])(state, k, x)
    got = np.asarray(observed["conv_general_dilated[0]"])

    # the oracle: the GEMM's operands made by hand (tests/_im2col.py)
    patches = im2col.patches(x, (3, 2), strides, pads, g)
    kernel_rows = im2col.kernel_rows(k, g)
    grad = im2col.gemm_output(cot, g)
    want = [*_rowwise_stats(patches), *_rowwise_stats(kernel_rows), *_rowwise_stats(grad)]
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)
    assert 0.1 < got[0] < 0.3 and 0.1 < got[4] < 0.2  # the faint channels underflow
    # a layout that is not the GEMM's (the gradient's last axis, width, as the contraction)
    # gives other statistics: the check can tell (the faint channel's rows do not underflow)
    assert _rowwise_stats(cot)[0] == 0

    # the forward: the recipe's convolution before the switch, the convolution as written
    # after (to float32 summation order: each loss is its own program)
    quantized = float(jax.jit(apply(loss, get_recipe("rowwise")))(k, x))
    written = float(jax.jit(loss)(k, x))
    assert abs(quantized - written) > 1e-3 * abs(written)
    fwd = jax.jit(lambda st, p, x: f.value_and_grad()(st, p, x)[0])
    assert float(fwd(state, k, x)) == pytest.approx(quantized, rel=1e-6)
    switched = f.update_state(state, jax.tree.map(lambda v: v + 1e31, observed))
    assert float(switched["conv_general_dilated[0]"]["switched"]) == 1.0
    assert float(fwd(switched, k, x)) == pytest.approx(written, rel=1e-6)


# --- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--compare", "fp32", "fp8"], "unknown variant 'fp8'"),
        (["--bisect", "fp16", "fp32", "--layers", "block*"], "'block*' matches no layer"),
        (["--bisect", "fp16", "fp32", "--layers", " , "], "--layers names no layer"),
        (["--autoswitch", "fp16"], "has no recipe"),
        (
            ["--compare", "fp32", "fp16", "--set", "variant.fp16.batch_size=32"],
            "do not share batch_size",
        ),
        (
            ["--compare", "fp32", "fp16", "--set", "variant.fp16.data=markov"],
            "model 'mlp' needs a classification dataset",
        ),
        (["--compare", "fp32", "fp16", "--tolerance", "1"], "--tolerance applies to --bisect"),
        (["--compare", "fp32", "fp16", "--threshold", "-1"], "threshold must be a number > 0"),
        ([], "give one of --compare"),
    ],
)
def test_bad_input_is_one_line_and_status_2(argv, message, tmp_path):
    status, out, err = _cli(BROKEN, *argv, "--out", str(tmp_path / "run"))
    assert status == 2 and out == ""
    assert err.startswith("precisionlab diagnose: error: ") and err.count("\n") == 1
    assert message in err
    assert not (tmp_path / "run").exists()


def test_the_files_diagnose_table_gives_defaults_that_flags_override():
    import argparse

    from precisionlab.cli import _diagnose_cmd as diagnose_cmd

    parser = argparse.ArgumentParser()
    diagnose_cmd.add_arguments(parser)
    exp, _ = d.load_units(BROKEN, ["fp16"], ["diagnose.tolerance=0.25", "diagnose.tail=3"])
    table = exp.resolved["diagnose"]
    args = parser.parse_args([BROKEN, "--bisect", "fp16", "fp32"])
    assert diagnose_cmd._options(args, "bisect", table) == d.BisectOptions(tolerance=0.25, tail=3)
    args = parser.parse_args([BROKEN, "--bisect", "fp16", "fp32", "--tolerance", "0.5"])
    assert diagnose_cmd._options(args, "bisect", table).tolerance == 0.5
    assert diagnose_cmd._options(args, "bisect", {}).tail == 10
    with pytest.raises(ValueError, match=r"diagnose\.tolerance"):
        d.load_units(BROKEN, ["fp16"], ["diagnose.tolerance=-1"])


def test_variants_in_several_settings_need_the_full_name(tmp_path):
    status, _, err = _cli(FP16, "--compare", "fp32", "bf16", "--out", str(tmp_path / "r"))
    assert status == 2 and "runs in several settings; name one of: underflow/fp32" in err


# --- compare: acceptance -------------------------------------------------------------------
def test_compare_finds_the_broken_layer_at_its_step(tmp_path):
    status, out, _ = _cli(
        BROKEN, "--compare", "fp32", "fp16", "--quiet", "--no-plots", "--out", str(tmp_path / "r")
    )
    assert status == 0
    assert "first break: step 1, layer layer4, tensor act:pre" in out
    assert "overflow float16" in out
    report = (tmp_path / "r" / "report.md").read_text()
    assert "layer4" in report and (tmp_path / "r" / "result.json").exists()


@pytest.mark.slow
def test_compare_points_at_the_highest_gradient_underflow_by_numpy_recount(tmp_path):
    _, (a, b) = d.load_units(FP16, ["underflow/fp32", "underflow/fp16-noscale"], ["train.steps=3"])
    r = d.compare(a, b, dump=tmp_path / "t.npz")
    z = np.load(tmp_path / "t.npz")
    scale = float(z["grad_scale"])
    assert scale == 2.0**-16
    recount: dict[str, float] = {}
    for key in z.files:
        if key.startswith("ref/") and key.endswith(".grad"):
            layer = key[4:].split(":")[0]
            g = z[key].astype(np.float64) * scale
            nz = (g != 0) & np.isfinite(g)
            # float16 rounds |x| <= 2^-25 (half its smallest subnormal; the tie goes to even) to 0
            under = np.sum(nz & (np.abs(g) <= 2.0**-25)) / np.sum(nz)
            recount[layer] = max(recount.get(layer, 0.0), under)
    assert set(recount) == set(r.grad_underflow)
    for layer, frac in recount.items():
        assert r.grad_underflow[layer] == pytest.approx(frac, abs=1e-12)
    assert r.first is not None and r.first.kind == "grad"
    assert recount[r.first.layer] == max(recount.values())


# --- bisect and autoswitch: real runs ----------------------------------------------------------
@pytest.mark.slow
def test_bisect_finds_the_broken_layer_in_at_most_four_runs(tmp_path):
    status, out, _ = _cli(
        BROKEN, "--bisect", "fp16", "fp32", "--steps", "10", "--quiet", "--out", str(tmp_path / "r")
    )
    assert status == 0
    assert "answer: return layer4 to high precision" in out
    result = d.BisectResult  # the search runs, from the stored result
    import json

    stored = json.loads((tmp_path / "r" / "result.json").read_text())
    search = [r for r in stored["runs"] if r["label"] == "search"]
    assert 1 <= len(search) <= 4 and result is not None
    assert (tmp_path / "r" / "plots" / "bisect_runs.png").exists()


@pytest.mark.slow
def test_bisect_in_the_underflow_setting_keeps_the_layer_with_the_most_underflow():
    # Every layer's activation gradients underflow (89-100% at step 1): no single layer fixes
    # the run; the answer must hold the layer where the underflow is highest.
    _, (a, b) = d.load_units(FP16, ["underflow/fp16-noscale", "underflow/fp32"], ["train.steps=60"])
    cmp = d.compare(b, a, d.CompareOptions(steps=1))
    worst = max(cmp.grad_underflow, key=cmp.grad_underflow.get)
    r = d.bisect(a, b)
    assert r.answer is not None and worst in r.answer


@pytest.mark.slow
def test_autoswitch_switches_every_matmul_at_zero_thresholds_and_none_at_infinite_ones():
    _, (u,) = d.load_units(BROKEN, ["e4m3"], ["train.steps=3"])
    every = d.autoswitch(u, d.SwitchOptions(underflow=0.0, mse=0.0), say=lambda m: None)
    assert every.sites and all(s["switched"] and s["step"] == 1 for s in every.sites)
    none = d.autoswitch(u, d.SwitchOptions(underflow=1.0, mse=1e30), say=lambda m: None)
    assert not any(s["switched"] for s in none.sites)
