"""The recipe contract (precisionlab.recipes.RecipeSpec / AppliedRecipe) is kept by the train
step's recipe and by diagnose's autoswitch recipe, with the same method signatures."""

import inspect

import jax.numpy as jnp

from precisionlab.diagnose._autoswitch import AutoSwitchRecipe
from precisionlab.recipes import AppliedRecipe, RecipeSpec, get_recipe
from precisionlab.train._recipe import TrainRecipe

METHODS = ("sites", "init_state", "value_and_grad", "update_state")


def _loss(w, x):
    return jnp.sum(x @ w)


def test_train_and_autoswitch_recipes_keep_the_contract():
    specs = [TrainRecipe(get_recipe("current")), AutoSwitchRecipe(get_recipe("current"))]
    for spec in specs:
        assert isinstance(spec, RecipeSpec)
        applied = spec.apply(_loss)
        assert isinstance(applied, AppliedRecipe), type(applied).__name__
        for name in METHODS:  # the same parameters as the Protocol's
            want = list(inspect.signature(getattr(AppliedRecipe, name)).parameters)[1:]
            assert list(inspect.signature(getattr(applied, name)).parameters) == want, name
        w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
        assert [s.name for s in applied.sites(w, x)] == ["dot_general[0]"]


def test_the_protocol_check_can_fail():
    class Partial:
        def sites(self, *a, **k):
            return []

    assert not isinstance(Partial(), AppliedRecipe)
