"""Training with a low-precision matmul recipe (``TrainConfig.recipe``)."""

from __future__ import annotations

import math
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from precisionlab import recipes
from precisionlab.train import TrainConfig, train
from precisionlab.train._recipe import TrainRecipe, parse_recipe
from precisionlab.train._specs import parse_step_options
from precisionlab.train._step import StepOptions, build_step

# A small MLP on the default teacher data: a few seconds per run on 2 busy cores.
SMALL = dict(model_kwargs={"width": 64, "depth": 1}, batch_size=32, steps=20, lr=1e-2)


def _run(**kw):
    return train(TrainConfig(**{**SMALL, **kw}), quiet=True)


def test_toml_name_and_table_parse_into_a_recipe():
    doc = tomllib.loads(
        """
        [a]
        recipe = "mxfp8"
        [b]
        recipe = {name = "mxfp8", scale_rule = "floor", exclude = [-1]}
        [c]
        recipe = {name = "delayed", amax_history_len = 16, include = ["dot_general[0]"]}
        """
    )
    a = TrainConfig.from_dict(doc["a"]).precision.recipe
    assert a.recipe == recipes.get_recipe("mxfp8", pad=True) and a.exclude == ()
    b = TrainConfig.from_dict(doc["b"]).precision.recipe
    assert b.recipe.scale_rule == "floor" and b.exclude == (-1,) and b.include is None
    c = TrainConfig.from_dict(doc["c"]).precision.recipe
    assert isinstance(c.recipe, recipes.Delayed) and c.recipe.amax_history_len == 16
    assert c.include == ("dot_general[0]",) and c.stateful
    assert TrainConfig().precision.recipe is None
    # a table may turn the training default (zero padding of block recipes) off
    assert parse_recipe({"name": "mxfp8", "pad": False}).recipe.pad is False


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("mxfp9", ["train.recipe", "unknown recipe 'mxfp9'", "mxfp8", "nvfp4"]),
        ({"name": "mxfp8", "margin": 1}, ["train.recipe", "no field(s) ['margin']", "scale_rule"]),
        ({"scale_rule": "floor"}, ["train.recipe", "needs a 'name'"]),
        ({"name": "mxfp8", "exclude": [1.5]}, ["train.recipe", "exclude", "1.5"]),
        (3, ["train.recipe", "recipe name or a table", "int 3"]),
    ],
)
def test_bad_recipe_is_one_line_naming_it(value, words):
    with pytest.raises(ValueError) as err:
        TrainConfig.from_dict({"recipe": value})
    message = str(err.value)
    assert "\n" not in message
    for w in words:
        assert w in message, (w, message)


def test_mxfp8_run_trains_and_differs_from_bf16():
    bf16 = _run(policy="p=f32,c=bf16,o=f32")
    mx = _run(policy="p=f32,c=bf16,o=f32", recipe="mxfp8")
    losses = [m["loss"] for m in mx.metrics]
    assert np.mean(losses[-5:]) < losses[0] - 0.4  # it learns
    assert mx.final_loss != bf16.final_loss  # the matmuls really went through the recipe
    assert abs(mx.final_loss - bf16.final_loss) < 0.2  # ... and stayed near bf16
    assert mx.state.recipe_state == {}  # a stateless recipe has an empty (pytree) state


def test_delayed_state_resumes_bitwise(tmp_path):
    cfg = dict(recipe={"name": "delayed", "amax_history_len": 4}, steps=6, checkpoint_interval=3)
    full = train(TrainConfig(**{**SMALL, **cfg}), checkpoint_dir=tmp_path / "full", quiet=True)
    part = train(TrainConfig(**{**SMALL, **cfg, "steps": 3}), checkpoint_dir=tmp_path, quiet=True)
    assert part.steps_done == 3
    resumed = train(
        TrainConfig(**{**SMALL, **cfg}), checkpoint_dir=tmp_path, resume=True, quiet=True
    )
    assert resumed.steps_done == 6
    a, b = jax.device_get(full.state), jax.device_get(resumed.state)
    assert set(a.recipe_state) == {"dot_general[0]", "dot_general[1]"}
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # the history holds the 4 newest steps' amaxes: all nonzero after 6 steps
    assert np.all(np.asarray(a.recipe_state["dot_general[0]"]["history"]) > 0)
    assert [m["loss"] for m in full.metrics[3:]] == [m["loss"] for m in resumed.metrics]


def _toy(params, batch):
    return jnp.mean((batch["x"] @ params["w"]) ** 2)


def test_skipped_step_leaves_delayed_state_unchanged():
    params = {"w": jnp.ones((32, 32), jnp.float32)}
    good = {"x": jnp.full((8, 32), 4.0, jnp.float32)}
    bad = {"x": good["x"].at[3, 5].set(jnp.nan)}  # a NaN input: non-finite gradients
    rec = TrainRecipe(recipes.get_recipe("delayed", amax_history_len=2))
    opts = parse_step_options(loss_scale="static:1", recipe=rec)
    fn, state, _ = build_step(_toy, params, optax.sgd(0.1), opts, good)
    for batch, skipped in ((bad, True), (good, False)):
        new, metrics = jax.jit(fn)(state, batch)
        assert bool(metrics["skipped"]) is skipped
        old_leaves, new_leaves = (
            jax.tree.leaves(state.recipe_state),
            jax.tree.leaves(new.recipe_state),
        )
        same = [np.array_equal(x, y) for x, y in zip(old_leaves, new_leaves, strict=True)]
        assert all(same) is skipped
    # the observed amax of x (all fours) is 4: TE's scale 448 / 4
    np.testing.assert_array_equal(new.recipe_state["dot_general[0]"]["history"][0, 0], 4)
    assert float(new.recipe_state["dot_general[0]"]["scale"][0]) == 112.0


def test_stateful_recipe_needs_an_example_batch():
    rec = TrainRecipe(recipes.get_recipe("delayed"))
    with pytest.raises(ValueError, match="example_batch"):
        build_step(_toy, {"w": jnp.ones((4, 4))}, optax.sgd(0.1), StepOptions(recipe=rec))
    with pytest.raises(TypeError, match="TrainRecipe"):
        StepOptions(recipe="mxfp8")


def _metrics(recipe, x, w):
    from precisionlab.mixed._loss_scale import NoLossScale
    from precisionlab.train._recipe_metrics import make_recipe_metrics_fn, recipe_metrics

    fn = make_recipe_metrics_fn(lambda p, b: jnp.sum(b["x"] @ p["w"]), parse_recipe(recipe))
    return recipe_metrics(jax.jit(fn)({"w": w}, {"x": x}, NoLossScale(), None, None))


def test_recipe_metrics_match_a_float64_oracle():
    import ml_dtypes

    # Each row (one 32-block along the contraction): 30 ones, one 1.9 and one 1e-6.
    x = np.ones((4, 32), np.float32)
    x[:, 0], x[:, 1] = 1.9, 1e-6
    w = np.ones((32, 8), np.float32)
    floor = _metrics({"name": "mxfp8", "scale_rule": "floor"}, x, w)
    rceil = _metrics({"name": "mxfp8", "scale_rule": "rceil"}, x, w)
    # OCP floor: X = 2^(floor(log2 1.9) - 8) = 2^-8; 1.9 / X = 486.4 > 448 clips; rceil:
    # X = 2^ceil(log2(1.9 / 448)) = 2^-7, 1.9 / X = 243.2 -> 240. 1e-6 / X is below E4M3's
    # smallest subnormal 2^-9 under both: it underflows.
    assert floor["x"]["saturated"] == 1 / 32 and rceil["x"]["saturated"] == 0
    assert floor["x"]["underflow"] == rceil["x"]["underflow"] == 1 / 32
    assert floor["x"]["log2_scale_min"] == floor["x"]["log2_scale_max"] == -8
    assert rceil["x"]["log2_scale_min"] == rceil["x"]["log2_scale_max"] == -7
    for got, scale in ((floor, 2.0**-8), (rceil, 2.0**-7)):
        xq = (x.astype(np.float64) / scale).clip(-448, 448)
        dq = xq.astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale
        x64 = x.astype(np.float64)
        sqnr = 10 * np.log10(np.sum(x64**2) / np.sum((x64 - dq) ** 2))
        assert abs(got["x"]["sqnr_db"] - sqnr) < 1e-4
    # the weights (ones) and output gradients (ones) are exact: no saturation, no noise
    for group in ("w", "g"):
        assert rceil[group]["saturated"] == 0 and rceil[group]["underflow"] == 0
        assert rceil[group]["sqnr_db"] == float("inf")
    assert _metrics("bf16", x, w) == {}  # the reference recipes quantize nothing


def _rowwise_metrics(t: np.ndarray) -> dict[str, float]:
    """The recipe metrics of float32 rows under the rowwise recipe (tests/_im2col.py's
    recount), the dequantization factor 1 / scale."""
    import _im2col as im2col

    t, elems, scale = im2col.rowwise_e4m3(t)
    dq, nz = elems / scale, t != 0
    return {
        "saturated": float(np.mean((np.abs(elems) >= 448) & (np.abs(t) > np.abs(dq)))),
        "underflow": float(np.sum(nz & (dq == 0)) / np.sum(nz)),
        "sqnr_db": float(10 * np.log10(np.sum(t**2) / np.sum((t - dq) ** 2))),
        "log2_scale_min": float(-np.log2(scale).max()),
        "log2_scale_max": float(-np.log2(scale).min()),
    }


def test_recipe_metrics_measure_a_convolution_on_its_gemm():
    """A convolution's recipe metrics are those of the GEMM the recipe runs for it: the
    patches, the kernel rows and the output gradient with the output channels along the
    contraction, recounted from a hand-made im2col (tests/_im2col.py). Convolutions used to
    be left out of the metrics, silently."""
    import _im2col as im2col

    from precisionlab.mixed._loss_scale import NoLossScale
    from precisionlab.train._recipe_metrics import make_recipe_metrics_fn, recipe_metrics

    rng = np.random.default_rng(4)
    n, c, h, w, o = 2, 4, 7, 6, 6
    strides, pads = (2, 1), ((1, 1), (0, 1))
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    x[:, 1] *= np.float32(2.0**-20)  # a faint channel: underflows in each patch row
    k = rng.standard_normal((o, c, 3, 2)).astype(np.float32)
    ho, wo = im2col.out_size(h, 3, 2, pads[0]), im2col.out_size(w, 2, 1, pads[1])
    cot = rng.standard_normal((n, o, ho, wo)).astype(np.float32)  # d loss / d output
    cot[:, 2] *= np.float32(2.0**-20)

    def loss(p, b):
        return jnp.sum(jax.lax.conv_general_dilated(b["x"], p["k"], strides, pads) * cot)

    fn = make_recipe_metrics_fn(loss, parse_recipe("rowwise"))
    got = recipe_metrics(jax.jit(fn)({"k": k}, {"x": x}, NoLossScale(), None, None))
    operands = {
        "x": im2col.patches(x, (3, 2), strides, pads, 1),
        "w": im2col.kernel_rows(k, 1),
        "g": im2col.gemm_output(cot, 1),
    }
    for group, t in operands.items():
        want = _rowwise_metrics(t)
        assert got[group] == pytest.approx(want, rel=1e-5), group
    assert got["x"]["underflow"] > 0.1 and got["g"]["underflow"] > 0.1


def test_a_cnn_trains_with_a_delayed_recipe_and_its_metrics_count_the_convolutions():
    """The built-in CNN under delayed scaling with recipe metrics: the metrics' sites are the
    recipe's own names (its per-site state is keyed by them; the convolutions included), and
    the convolutions count: the metrics of the whole model differ from those of its dense
    head alone."""
    cfg = dict(model="conv", data="digits", model_kwargs={"width": 8, "depth": 2}, steps=2,
               batch_size=32, eval_batches=1, hist_interval=1, progress=False)  # fmt: skip
    every = train(TrainConfig(**cfg, recipe={"name": "delayed"}), quiet=True)
    head = train(TrainConfig(**cfg, recipe={"name": "delayed", "include": ["dot_general*"]}),
                 quiet=True)  # fmt: skip
    rm, rm_head = every.summary()["recipe_metrics"], head.summary()["recipe_metrics"]
    assert set(rm) == {"x", "w", "g"} and all(math.isfinite(v["sqnr_db"]) for v in rm.values())
    assert rm["x"] != rm_head["x"] and rm["w"] != rm_head["w"]


def test_recipe_metrics_reach_the_result_and_records():
    cfg = {**SMALL, "model_kwargs": {"width": 32, "depth": 1}, "steps": 3, "hist_interval": 2}
    res = train(TrainConfig(**cfg, recipe={"name": "mxfp8", "scale_rule": "floor"}), quiet=True)
    rm = res.summary()["recipe_metrics"]
    assert set(rm) == {"x", "w", "g"}
    assert set(rm["g"]) == {"saturated", "underflow", "sqnr_db", "log2_scale_min", "log2_scale_max"}
    assert 0 < rm["x"]["saturated"] < 0.2 and rm["x"]["sqnr_db"] > 20
    assert "recipe_g_saturated" in res.metrics[0] and "recipe_g_saturated" not in res.metrics[1]
    assert TrainConfig().recipe is None and res.summary()["steps_done"] == 3


def test_fp8_recipes_experiment_validates_and_cli_errors_are_one_line(capsys):
    from pathlib import Path

    from precisionlab.cli import main
    from precisionlab.experiments._config import load_experiment

    path = Path(__file__).parents[2] / "experiments" / "fp8_recipes.toml"
    exp = load_experiment(path)
    assert exp.kind == "train" and len(exp.units) == 13
    outliers = load_experiment(path.with_name("fp8_recipes_outliers.toml"))
    assert outliers.kind == "train" and len(outliers.units) == 6
    assert main(["run", str(path), "--set", "variant.current.recipe=mxfp9", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown recipe 'mxfp9'" in err and "(current).recipe" in err
