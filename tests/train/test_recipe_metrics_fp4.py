"""Training with an FP4 recipe and histograms: the recipe metrics (statistics of each operand
against the tensor the model holds) are not taken for FP4 recipes, whose GEMMs multiply
rotated, re-scaled or stateful operands; a warning says so and the run goes on. Before, every
FP4 recipe crashed there (``fmt`` is a string on FP4 recipes: 'str' object is not callable;
TetraJet's state has no 'scale': KeyError)."""

import math

import pytest

from precisionlab.train import TrainConfig, train


@pytest.mark.parametrize("recipe", ["nvidia_fp4", pytest.param("tetrajet", marks=pytest.mark.slow)])
def test_an_fp4_recipe_trains_with_histograms_and_says_what_it_skips(recipe):
    config = TrainConfig(
        model="mlp", data="teacher", recipe=recipe, steps=1, hist_interval=1, batch_size=16
    )
    with pytest.warns(UserWarning, match=f"not measured for the FP4 recipe '{recipe}'"):
        result = train(config, quiet=True)
    assert result.steps_done == 1 and math.isfinite(result.final_loss)
    assert result.recipe_metrics is None
    assert result.mean_underflow_fraction is not None  # the histogram steps still probed
