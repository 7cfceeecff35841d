"""Training with a low-precision matmul recipe (``TrainConfig.recipe``)."""

from __future__ import annotations

import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from precisionlab import recipes
from precisionlab.train import TrainConfig, train
from precisionlab.train.recipe import TrainRecipe, parse_recipe
from precisionlab.train.step import StepOptions, build_step

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
    opts = StepOptions.parse(loss_scale="static:1", recipe=rec)
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
