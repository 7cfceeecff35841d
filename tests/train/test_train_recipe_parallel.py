"""A recipe run data parallel over 4 host devices: delayed scaling's observations are combined
with a max over devices, so the activation and weight amaxes (and scales) equal one device's
exactly; the output-gradient amax is the device's own gradient's (its loss is the mean over its
shard: about 4x the full batch's).

Runs in a subprocess: the device count must be set (XLA_FLAGS) before jax is imported.
"""

import textwrap

SCRIPT = textwrap.dedent(
    """
    import jax, numpy as np, optax
    assert jax.device_count() == 4, jax.devices()
    from precisionlab.train import StepOptions, build_step, make_data, make_model
    from precisionlab.train._parallel import shard_batch
    from precisionlab.train._recipe import parse_recipe

    data = make_data("teacher")
    model = make_model("mlp", width=32, depth=1, **data.model_kwargs())
    params = model.init(jax.random.PRNGKey(0))
    loss_fn = model.loss_fn("p=f32,c=f32,o=f32")
    rec = parse_recipe({"name": "delayed", "amax_history_len": 2})
    batch = data.batch(0, 64)

    def run(dp):
        options = StepOptions(data_parallel=dp, recipe=rec)
        step, state, mesh = build_step(loss_fn, params, optax.adam(1e-2), options, batch)
        b = shard_batch(batch, mesh) if dp else batch
        state, m = jax.jit(step)(state, b)
        return jax.device_get(state.recipe_state), m

    one, m1 = run(False)
    four, m4 = run(True)
    assert set(one) == set(four) == {"dot_general[0]", "dot_general[1]"}
    for k in one:
        h1, h4 = np.asarray(one[k]["history"][0]), np.asarray(four[k]["history"][0])
        np.testing.assert_array_equal(h1[:2], h4[:2])  # lhs, rhs: the max over devices
        np.testing.assert_allclose(h4[2], 4 * h1[2], rtol=0.02)  # per-shard gradient: 4x
        assert np.all(h1 > 0)
    np.testing.assert_allclose(float(m1["loss"]), float(m4["loss"]), rtol=1e-6)
    print("OK")
    """
)


def test_delayed_recipe_four_devices_match_one(run_on_host_devices):
    run_on_host_devices(SCRIPT, devices=4)
